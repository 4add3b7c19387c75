"""The ``vllm.general_plugins`` entry point: kvarn presets become KV-cache dtypes of vLLM.

:func:`register` runs in every vLLM process (front end, engine core, each worker; vLLM may call it
more than once, so it is idempotent). It

1. registers every known preset name (built-ins, the bundled ``presets/`` folder, the folders in
   ``KVARN_PRESET_PATH`` and the user preset folder; plus the names the front end resolved that no
   preset file lists, such as ``kvarn_k4v2_g128_sink1``, passed to the processes it spawns in
   ``KVARN_RESOLVED_DTYPES``) as a KV-cache dtype, each resolved once into its Scheme
   (:data:`kvarn.vllm.registry.DTYPES`; the settings read from the environment go to
   :data:`kvarn.vllm.registry.SETTINGS`), through vLLM 0.33's ``register_kv_cache_dtype``
   (:mod:`kvarn.vllm.compat`) or, on 0.32, :func:`kvarn.vllm.patches.extend_cache_dtype_literal`;
2. adds ``KVARN`` and ``KVARN_MLA`` to vLLM's attention-backend registry;
3. registers ``KvarnStorageConnector`` with vLLM's ``KVConnectorFactory``
   (:mod:`kvarn.vllm.connectors`);
4. installs every patch of vLLM internals (:func:`kvarn.vllm.patches.install`): attention is routed
   to :class:`kvarn.vllm.backend.KvarnAttentionBackend` (MLA layers on the CPU:
   :class:`kvarn.vllm.mla.KvarnMLABackend`) for a kvarn dtype only, and every ``kv_cache_dtype``
   goes through :func:`resolve_dtype` in ``EngineArgs`` (``LLM()``) and ``--kv-cache-dtype``
   (``vllm serve``).

This module and the CLIs are the only places that read the environment.

Usage::

    LLM(model=..., kv_cache_dtype="kvarn_k4v2_g128", block_size=128)
    vllm serve MODEL --kv-cache-dtype kvarn_k4v2_g128 --block-size 128
"""

from __future__ import annotations

import logging
import os

from kvarn.schemes import BUILTINS, Scheme, UnknownSchemeError, get_preset, list_presets
from kvarn.vllm import compat, connectors, patches
from kvarn.vllm.registry import DTYPES, SETTINGS, is_kvarn_dtype, vllm_dtypes

logger = logging.getLogger("kvarn.vllm")

BACKEND_NAME = "KVARN"
BACKEND_PATH = "kvarn.vllm.backend.KvarnAttentionBackend"
MLA_BACKEND_NAME = "KVARN_MLA"
MLA_BACKEND_PATH = "kvarn.vllm.mla.KvarnMLABackend"
STAGING_SLOTS_ENV = "KVARN_STAGING_SLOTS"
# "triton" or "cpu": the attention ops every kvarn layer uses, whatever its device (unset: by device).
# "triton" on a CPU runs the CUDA serving path's kernels under Triton's interpreter (TRITON_INTERPRET=1).
OPS_ENV = "KVARN_OPS"
# Names resolved in the front end that no preset file lists (canonical names such as
# kvarn_k4v2_g128_sink1): exported here so that the engine and worker processes, which vLLM spawns
# with this environment and which only scan the preset folders, register them too.
RESOLVED_ENV = "KVARN_RESOLVED_DTYPES"


def known_names() -> list[str]:
    """Every preset name found now: built-ins first, then user presets (scanned from disk)."""
    return [p.name for p in list_presets()]


def register_dtypes(names: list[str]) -> None:
    """Make each of ``names`` a valid ``kv_cache_dtype`` (packed bytes, stored as ``uint8``).

    Raises:
        UnknownSchemeError, PresetError: a name resolves to no scheme.
    """
    _add({n: DTYPES.schemes.get(n) or get_preset(n).scheme for n in names})


def _add(schemes: dict[str, Scheme]) -> None:
    """Record ``schemes`` in :data:`DTYPES` and make their names ``kv_cache_dtype`` values of vLLM."""
    DTYPES.add(schemes)
    if not compat.register(list(schemes)):  # vLLM 0.32: no registration hook
        patches.extend_cache_dtype_literal(list(schemes))


def resolve_dtype(name: str) -> str:
    """The one resolver for ``kv_cache_dtype`` values: vLLM's own pass, kvarn's are registered.

    A name :func:`kvarn.schemes.get_preset` resolves (built-in, preset file or ``name:``, canonical
    scheme name) is registered as given and as its preset's name, and exported in
    ``KVARN_RESOLVED_DTYPES`` for the processes vLLM spawns.

    Raises:
        UnknownSchemeError: neither vLLM's nor kvarn's; lists both (and broken preset files that
            may define the name).
        PresetError: the name is a preset file that cannot be loaded.
    """
    if name in DTYPES.schemes or name in vllm_dtypes():
        return name
    try:
        preset = get_preset(name)
    except UnknownSchemeError as e:
        msg = str(e).rstrip(".")
        raise UnknownSchemeError(
            f"{msg}{' ' if msg.endswith('?') else '. '}vLLM's own kv-cache dtypes: {', '.join(vllm_dtypes())}"
        ) from None
    _add({name: preset.scheme, preset.name: preset.scheme})
    resolved = [n for n in os.environ.get(RESOLVED_ENV, "").split(",") if n]
    if name not in resolved:
        os.environ[RESOLVED_ENV] = ",".join([*resolved, name])
    return name


def _startup_schemes() -> dict[str, Scheme]:
    """Name -> Scheme of every preset found, then of the names in ``KVARN_RESOLVED_DTYPES``.

    Never raises: a broken preset folder or a stale name is logged and skipped, so that vLLM keeps
    working for other dtypes (vLLM does not catch a plugin's exceptions).
    """
    try:
        schemes = {p.name: p.scheme for p in list_presets()}
    except Exception as e:
        logger.warning("kvarn: could not list presets (%s); registering built-ins only", e)
        schemes = dict(BUILTINS)
    for extra in filter(None, os.environ.get(RESOLVED_ENV, "").split(",")):
        try:  # the name as the front end was given it, and its preset's name
            preset = get_preset(extra)
        except Exception as e:
            logger.warning("kvarn: %s lists %r, which does not resolve (%s); skipped", RESOLVED_ENV, extra, e)
            continue
        schemes.setdefault(extra, preset.scheme)
        schemes.setdefault(preset.name, preset.scheme)
    return schemes


def _register_backends() -> None:
    """Add ``KVARN`` and ``KVARN_MLA`` to vLLM's attention-backend registry (it looks backends up by name)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    for name, path in ((BACKEND_NAME, BACKEND_PATH), (MLA_BACKEND_NAME, MLA_BACKEND_PATH)):
        if name not in AttentionBackendEnum.__members__ and not hasattr(AttentionBackendEnum, name):
            register_backend(name, path)


def register() -> None:
    """Entry point (``vllm.general_plugins``): kvarn dtypes, attention backends, the connector and patches."""
    schemes = _startup_schemes()
    SETTINGS.staging_slots = os.environ.get(STAGING_SLOTS_ENV, "")
    SETTINGS.ops = os.environ.get(OPS_ENV, "")
    _add(schemes)
    _register_backends()
    connectors.register()
    patches.install(resolve_dtype, backend=BACKEND_PATH, mla_backend=MLA_BACKEND_PATH)
    logger.debug("kvarn: registered %d KV-cache dtypes: %s", len(schemes), ", ".join(schemes))


__all__ = [
    "BACKEND_PATH",
    "RESOLVED_ENV",
    "UnknownSchemeError",
    "is_kvarn_dtype",
    "known_names",
    "register",
    "register_dtypes",
    "resolve_dtype",
]
