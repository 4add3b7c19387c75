"""The registry: built-in schemes plus user presets found by name, and lookup with clear errors.

Lookup order for :func:`get_preset`: a built-in name; a path to a YAML file; a ``name:`` in a
preset directory (the user preset directory, then the directories in ``KVARN_PRESET_PATH``, then the
bundled ``presets/`` folder); finally any canonical scheme name (``kvarn_k3v3_g64_s8``).

A name defined by files in more than one place is a clash (:class:`PresetClash`): the file in the
first directory of :func:`search_path` wins, and looking the name up logs a warning naming every
file and the one used. The user preset directory comes first because ``kvarn-tune`` writes there:
a name in it is the user's own, most recent measurement, while ``KVARN_PRESET_PATH`` adds shared
collections (such as the committed ``docs/tuned``).
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvarn.schemes.presets import Preset, PresetError, load_preset
from kvarn.schemes.scheme import Scheme, SchemeError

# Every built-in keeps the first token of each sequence exactly (Scheme.sink_tokens defaults to 1);
# ``<name>_sink0`` is the same layout without it.
BUILTINS: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme(4, 2, 128),  # the reference preset (KVarN's shipped layout)
        Scheme(4, 4, 128),
        Scheme(4, 2, 64),
        Scheme(4, 4, 64),
        Scheme(2, 2, 128),
        Scheme(3, 2, 128),
        Scheme(4, 3, 128),
        Scheme(4, 2, 128, scale_dtype="log8"),  # smaller scales: 3.19 bits/element at head_dim 128 (tiles)
    )
}

PRESET_PATH_ENV = "KVARN_PRESET_PATH"

log = logging.getLogger(__name__)


class UnknownSchemeError(KeyError):
    """No scheme or preset by that name; the message lists the valid names and the closest one."""

    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return str(self.args[0])


def bundled_preset_dir() -> Path:
    """The ``presets/`` folder shipped next to the package (present in a source checkout)."""
    return Path(__file__).resolve().parents[2] / "presets"


def user_preset_dir() -> Path:
    """Where ``kvarn-tune`` writes presets by default: ``$XDG_CONFIG_HOME/kvarn/presets``."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "kvarn" / "presets"


def search_path() -> list[Path]:
    """Preset directories in lookup order (the first that defines a name wins): the user preset
    directory, the directories in ``KVARN_PRESET_PATH``, the bundled ``presets/``. The one place
    ``KVARN_PRESET_PATH`` is read."""
    dirs = [user_preset_dir()]
    dirs += [Path(p) for p in os.environ.get(PRESET_PATH_ENV, "").split(os.pathsep) if p]
    dirs.append(bundled_preset_dir())
    return dirs


@dataclass(frozen=True)
class PresetProblem:
    """A preset file in a preset directory that could not be loaded, so it defines no name.

    Attributes:
        path: the file.
        message: the :class:`PresetError` message (file, field, value and allowed values; for
            malformed YAML the parser's message).
        names: names the file may have meant to define: its ``name:`` line if one can be read
            from the raw text, and its file stem.
    """

    path: Path
    message: str
    names: tuple[str, ...]

    def __str__(self) -> str:
        return self.message


_RAW_NAME_RE = re.compile(r"^name:\s*['\"]?([A-Za-z0-9_.\-]+)", re.MULTILINE)


def _problem(path: Path, err: PresetError) -> PresetProblem:
    try:
        raw = path.read_text(errors="replace")
    except OSError:
        raw = ""
    names = [m[1] for m in _RAW_NAME_RE.finditer(raw)] + [path.stem]
    return PresetProblem(path, str(err), tuple(dict.fromkeys(names)))


@dataclass(frozen=True)
class PresetClash:
    """One preset name defined by more than one preset file; the first in lookup order wins.

    Attributes:
        name: the clashing name.
        winner: the file the name resolves to (first in :func:`search_path` order).
        shadowed: the other files that define it, in lookup order (ignored).
    """

    name: str
    winner: Path
    shadowed: tuple[Path, ...]

    def __str__(self) -> str:
        others = ", ".join(map(str, self.shadowed))
        return (
            f"preset name {self.name!r} is defined by {1 + len(self.shadowed)} files: {self.winner} is used, "
            f"{others} ignored (the user preset directory comes first, then KVARN_PRESET_PATH, then the bundled "
            "presets/); rename one, or pass the file path instead of the name"
        )


@dataclass(frozen=True)
class _Scan:
    found: dict[str, Preset]
    broken: list[PresetProblem]
    clashes: dict[str, PresetClash]


def _scan(dirs: list[Path]) -> _Scan:
    found: dict[str, Preset] = {}
    broken: list[PresetProblem] = []
    files: dict[str, list[Path]] = {}
    for d in dirs:
        if not d.is_dir():
            continue
        for f in sorted([*d.glob("*.yaml"), *d.glob("*.yml")]):
            try:
                p = load_preset(f)
            except PresetError as e:
                broken.append(_problem(f, e))
                continue
            seen = files.setdefault(p.name, [])
            if f.resolve() not in [s.resolve() for s in seen]:  # a folder listed twice is no clash
                seen.append(f)
            found.setdefault(p.name, p)  # earlier directories win
    clashes = {n: PresetClash(n, fs[0], tuple(fs[1:])) for n, fs in files.items() if len(fs) > 1 and n not in BUILTINS}
    return _Scan(found, broken, clashes)


def preset_clashes(dirs: list[Path] | None = None) -> list[PresetClash]:
    """Every preset name that more than one file in the preset directories defines.

    Built-in names are left out: a file may only spell a built-in's own scheme under its name (see
    :func:`kvarn.schemes.presets.preset_from_dict`), and the built-in wins regardless.

    Args:
        dirs: directories to scan; default :func:`search_path`.
    """
    return sorted(_scan(search_path() if dirs is None else dirs).clashes.values(), key=lambda c: c.name)


@functools.cache
def _warn_clash(clash: PresetClash) -> None:
    """Log a clash once per process (vLLM looks a name up many times)."""
    log.warning("kvarn: %s", clash)


def preset_problems(dirs: list[Path] | None = None) -> list[PresetProblem]:
    """Every preset file in the preset directories that cannot be loaded (and is therefore skipped).

    Args:
        dirs: directories to scan; default :func:`search_path` (bundled ``presets/``,
            ``KVARN_PRESET_PATH``, the user preset directory).

    Example:
        >>> for problem in preset_problems():  # doctest: +SKIP
        ...     print("warning:", problem)
    """
    return _scan(search_path() if dirs is None else dirs).broken


def list_presets(dirs: list[Path] | None = None) -> list[Preset]:
    """Every known preset: built-ins first, then user presets (by name) from ``dirs``; a name that
    several files define appears once, from the file that wins (see :func:`preset_clashes`)."""
    user = _scan(search_path() if dirs is None else dirs).found
    out = [Preset(name, s) for name, s in BUILTINS.items()]
    out += [p for name, p in sorted(user.items()) if name not in BUILTINS]
    return out


def get_preset(name: str, dirs: list[Path] | None = None) -> Preset:
    """Find a preset by built-in name, file path, preset ``name:``, or canonical scheme name.

    A name that several preset files define resolves to the first in ``dirs`` order and logs a
    warning (once per process) naming every file and the one used.

    Raises:
        UnknownSchemeError: nothing by that name; lists the valid names and the closest match.
        PresetError: the name is a file that is not a valid preset.
    """
    if name in BUILTINS:
        return Preset(name, BUILTINS[name])
    if name.endswith((".yaml", ".yml")) or os.sep in name:
        return load_preset(name)
    scan = _scan(search_path() if dirs is None else dirs)
    user, broken = scan.found, scan.broken
    if name in user:
        if name in scan.clashes:
            _warn_clash(scan.clashes[name])
        return user[name]
    if name.startswith("kvarn_"):
        try:
            return Preset(name, Scheme.from_name(name), source="canonical name")
        except SchemeError as e:
            reason = f" ({e})"
        else:  # pragma: no cover - from_name either returns or raises
            reason = ""
    else:
        reason = ""
    valid = [*BUILTINS, *sorted(set(user) - set(BUILTINS))]
    close = difflib.get_close_matches(name, valid, n=1)
    msg = f"unknown kvarn scheme {name!r}{reason}. Known: {', '.join(valid)}"
    if close:
        msg += f". Did you mean {close[0]!r}?"
    raise UnknownSchemeError(msg + _broken_note(name, broken))


def _broken_note(name: str, broken: list[PresetProblem]) -> str:
    """The part of an unknown-name message about preset files that failed to load."""
    if not broken:
        return ""
    suspects = [p for p in broken if name in p.names]
    if suspects:
        return f". {name!r} may be defined by a preset file that failed to load: " + "; ".join(map(str, suspects))
    return ". Preset files that failed to load (skipped): " + "; ".join(map(str, broken))


def get_scheme(name: str, dirs: list[Path] | None = None) -> Scheme:
    """The :class:`Scheme` of :func:`get_preset`."""
    return get_preset(name, dirs).scheme
