"""The kvarn names this process serves as ``kv_cache_dtype`` values, each resolved once into its Scheme.

:data:`DTYPES` is filled by :mod:`kvarn.vllm.plugin` (at plugin load, and by ``resolve_dtype`` for
names resolved later), which also makes each name a valid ``kv_cache_dtype`` of the installed vLLM;
every other module asks it for a name's :class:`~kvarn.schemes.Scheme` instead of resolving the name
again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvarn.schemes import Scheme, get_preset
from kvarn.vllm import compat

if TYPE_CHECKING:
    from kvarn.kernels.api import AttentionOps

PREFIX = "kvarn_"
DEFAULT_INITIAL_SLOTS = 16


@dataclass
class KvarnDtypes:
    """Name -> Scheme of every kvarn ``kv_cache_dtype`` registered in this process.

    ``staging_env``: the raw ``KVARN_STAGING_SLOTS`` setting the entry point read at plugin load
    ("" when unset); :meth:`staging_slots` validates it where the pools are sized. ``ops_env``: the
    raw ``KVARN_OPS`` setting; :meth:`ops` validates it.
    """

    schemes: dict[str, Scheme] = field(default_factory=dict)
    staging_env: str = ""
    ops_env: str = ""

    def ops(self) -> AttentionOps | None:
        """The attention ops ``KVARN_OPS`` names (``triton`` or ``cpu``), or None (by device).

        Raises:
            ValueError: another value.
        """
        if not self.ops_env:
            return None
        if self.ops_env == "triton":
            from kvarn.kernels.triton import ops as triton_ops

            return triton_ops
        if self.ops_env == "cpu":
            from kvarn.kernels.cpu import ops as cpu_ops

            return cpu_ops
        raise ValueError(f"KVARN_OPS={self.ops_env!r} is not one of: triton, cpu (or unset: by device)")

    def add(self, schemes: dict[str, Scheme]) -> None:
        """Record ``schemes`` (name -> scheme); names already known keep their scheme."""
        for name, scheme in schemes.items():
            self.schemes.setdefault(name, scheme)

    def names(self) -> list[str]:
        """The registered names, in registration order."""
        return list(self.schemes)

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

    def staging_slots(self, max_num_seqs: int) -> int:
        """Staging (and sink) slots per layer: ``max(max_num_seqs, KVARN_STAGING_SLOTS)``.

        Unset, the setting counts as ``min(max_num_seqs, 16)``, so the slots are ``max_num_seqs``.

        Raises:
            ValueError: ``KVARN_STAGING_SLOTS`` is set but not a positive integer.
        """
        raw = self.staging_env
        if raw and (not raw.isdigit() or int(raw) < 1):
            raise ValueError(f"KVARN_STAGING_SLOTS={raw!r} must be a positive integer")
        initial = int(raw) if raw else min(max_num_seqs, DEFAULT_INITIAL_SLOTS)
        return max(max_num_seqs, initial)


DTYPES = KvarnDtypes()


def is_kvarn_dtype(cache_dtype: object) -> bool:
    """Whether a ``kv_cache_dtype`` value names a kvarn preset (:meth:`KvarnDtypes.is_kvarn`)."""
    return DTYPES.is_kvarn(cache_dtype)


def scheme_of(cache_dtype: str) -> Scheme:
    """The Scheme of a kvarn ``kv_cache_dtype`` (:meth:`KvarnDtypes.scheme`)."""
    return DTYPES.scheme(cache_dtype)


def vllm_dtypes() -> list[str]:
    """vLLM's own ``kv_cache_dtype`` values, without kvarn's."""
    return compat.vllm_dtypes(exclude=DTYPES.schemes)
