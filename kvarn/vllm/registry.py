"""The kvarn names this process serves as ``kv_cache_dtype`` values, and the plugin's settings.

Both are process-wide because vLLM's plugin hook forces it: the ``vllm.general_plugins`` entry point
(:func:`kvarn.vllm.plugin.register`) takes no arguments and returns nothing, and vLLM validates a
``kv_cache_dtype`` against process-wide lists. The entry point fills :data:`DTYPES` (at plugin load,
and through ``resolve_dtype`` for names resolved later) and :data:`SETTINGS` (from the environment);
an engine's :class:`~kvarn.vllm.context.EngineSpec` reads both once, when it is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvarn.schemes import Scheme, get_preset
from kvarn.vllm import compat

PREFIX = "kvarn_"
DEFAULT_INITIAL_SLOTS = 16


@dataclass
class KvarnDtypes:
    """Name -> Scheme of every kvarn ``kv_cache_dtype`` registered in this process."""

    schemes: dict[str, Scheme] = field(default_factory=dict)

    def add(self, schemes: dict[str, Scheme]) -> None:
        """Record ``schemes`` (name -> scheme); names already known keep their scheme."""
        for name, scheme in schemes.items():
            self.schemes.setdefault(name, scheme)

    def is_kvarn(self, cache_dtype: object) -> bool:
        """Whether a ``kv_cache_dtype`` value names a kvarn preset (``kvarn_*`` or a registered name)."""
        return isinstance(cache_dtype, str) and (cache_dtype.startswith(PREFIX) or cache_dtype in self.schemes)

    def scheme(self, cache_dtype: str) -> Scheme:
        """The Scheme a kvarn ``kv_cache_dtype`` names (resolved once; an unregistered name on first use).

        Raises:
            UnknownSchemeError, PresetError: as :func:`kvarn.schemes.get_preset` for a name that
                resolves to nothing.
        """
        found = self.schemes.get(cache_dtype)
        if found is None:
            found = self.schemes[cache_dtype] = get_preset(cache_dtype).scheme
        return found


@dataclass
class PluginSettings:
    """The environment the entry point read at plugin load, raw ("" when unset), validated where used.

    ``staging_slots``: ``KVARN_STAGING_SLOTS`` (:meth:`slots`); ``ops``: ``KVARN_OPS``, the kernel
    backend every kvarn layer uses (``triton`` or ``cpu``; unset: by device).
    """

    staging_slots: str = ""
    ops: str = ""

    def slots(self, max_num_seqs: int) -> int:
        """Staging (and sink) slots per layer: ``max(max_num_seqs, KVARN_STAGING_SLOTS)``.

        Unset, the setting counts as ``min(max_num_seqs, 16)``, so the slots are ``max_num_seqs``.

        Raises:
            ValueError: ``KVARN_STAGING_SLOTS`` is set but not a positive integer.
        """
        raw = self.staging_slots
        if raw and (not raw.isdigit() or int(raw) < 1):
            raise ValueError(f"KVARN_STAGING_SLOTS={raw!r} must be a positive integer")
        initial = int(raw) if raw else min(max_num_seqs, DEFAULT_INITIAL_SLOTS)
        return max(max_num_seqs, initial)


DTYPES = KvarnDtypes()  # process-wide: vLLM's dtype lists are (see the module docstring)
SETTINGS = PluginSettings()  # process-wide: the entry point's only way to hand on what it read


def is_kvarn_dtype(cache_dtype: object) -> bool:
    """Whether a ``kv_cache_dtype`` value names a kvarn preset (:meth:`KvarnDtypes.is_kvarn`)."""
    return DTYPES.is_kvarn(cache_dtype)


def vllm_dtypes() -> list[str]:
    """vLLM's own ``kv_cache_dtype`` values, without kvarn's."""
    return compat.vllm_dtypes(exclude=DTYPES.schemes)
