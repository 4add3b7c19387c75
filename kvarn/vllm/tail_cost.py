"""What a running request costs in vLLM's blocks with its 16-bit tail (:mod:`kvarn.vllm.tail`), and
the line kvarn logs about it at start-up."""

from __future__ import annotations

from kvarn.vllm.tail import TailLayout


def request_blocks(tokens: int, block_size: int, layout: TailLayout | None = None) -> int:
    """Blocks of ``block_size`` tokens a running request of ``tokens`` tokens holds: its tokens' blocks,
    and with a kvarn ``layout`` its tail blocks (:meth:`TailLayout.table_blocks`; none before it holds
    a token)."""
    if layout is None or tokens <= 0:
        return -(-tokens // block_size) if tokens > 0 else 0
    return -(-layout.table_blocks(tokens) * layout.group_size // block_size)


def requests_that_fit(num_blocks: int, per_request: int) -> int:
    """Requests holding ``per_request`` blocks each that fit at once in a pool of ``num_blocks`` blocks
    (vLLM's ``num_blocks``, of which its block pool keeps one back as the null block)."""
    return max(num_blocks - 1, 0) // per_request if per_request > 0 else 0


def describe(
    layout: TailLayout,
    tile_bytes: int,
    block_size: int,
    max_model_len: int | None = None,
    num_blocks: int | None = None,
) -> str:
    """One line for the start-up log: what a running request holds beyond its tiles, and what requests
    of 1,024 and of ``max_model_len`` tokens cost in blocks (:func:`request_blocks`) and how many fit
    at once in ``num_blocks``.

    ``tile_bytes``: bytes of one tile over every kvarn layer; ``block_size``: vLLM's block (several
    tiles in a hybrid model, whose other groups' blocks are not counted here)."""
    blocks = -(-layout.blocks * layout.group_size // block_size)
    tokens = blocks * block_size
    held = f"{blocks} blocks beyond its complete tiles" if layout.forward else f"{blocks} blocks beyond its tiles"
    line = (
        f"{str(layout.dtype).removeprefix('torch.')} tails in vLLM's block pool: each running request holds {held} ({tokens} tokens of "
        f"packed capacity, ~{tokens // layout.group_size * tile_bytes / 2**20:.1f} MiB), freed when it "
        "finishes; no staging pool"
    )
    sizes = [n for n in dict.fromkeys((1024, max_model_len)) if n]
    if not sizes:
        return line
    costs = []
    for n in sizes:
        cost = request_blocks(n, block_size, layout)
        fit = f", {requests_that_fit(num_blocks, cost)} at once in {num_blocks} blocks" if num_blocks else ""
        label = " (max_model_len)" if n == max_model_len else ""
        costs.append(f"{n:,} tokens{label}: {cost} blocks{fit}")
    return f"{line}; a request of {'; of '.join(costs)}"
