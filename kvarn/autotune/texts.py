"""A user's tuning text (``--text``): its calibration / held-out split, and its hash."""

from __future__ import annotations

import hashlib

SPLITS: tuple[str, ...] = ("interleaved", "contiguous")


def split_text(text: str, holdout: float, mode: str = "interleaved") -> tuple[str, str]:
    """Split ``text`` into (calibration, held-out) parts that share no paragraph.

    ``interleaved`` (default): paragraphs (blank-line separated) are dealt out in turn, a
    ``holdout`` share of them to the held-out part, so both parts sample the whole text and a
    document whose halves differ in difficulty (docs/tuning.md, run C) does not calibrate on one
    half and confirm on the other. ``contiguous``: the first ``1 - holdout`` of the text, then the
    rest, cut at a paragraph (else a line, else a space) boundary so no word straddles the two. A
    text with fewer than 4 paragraphs is always cut contiguously.

    Raises:
        ValueError: ``holdout`` outside (0, 1), or an unknown ``mode``.
    """
    if not 0.0 < holdout < 1.0:
        raise ValueError(f"holdout={holdout} must be strictly between 0 and 1")
    if mode not in SPLITS:
        raise ValueError(f"split mode {mode!r} is not known; allowed: {', '.join(SPLITS)}")
    paras = [p for p in text.split("\n\n") if p.strip()]
    if mode == "interleaved" and len(paras) >= 4:
        calib: list[str] = []
        held: list[str] = []
        for i, p in enumerate(paras):  # paragraph i is held out when the running share steps up
            (held if int((i + 1) * holdout) > int(i * holdout) else calib).append(p)
        return "\n\n".join(calib), "\n\n".join(held)
    cut = int(len(text) * (1.0 - holdout))
    for sep in ("\n\n", "\n", " "):
        i = text.find(sep, cut)
        if 0 < i < len(text) - 1:
            return text[:i], text[i + len(sep) :]
    return text[:cut], text[cut:]


def text_hash(text: str) -> str:
    """SHA-256 of the UTF-8 text, hex: identifies the text in study names, caches and provenance."""
    return hashlib.sha256(text.encode()).hexdigest()
