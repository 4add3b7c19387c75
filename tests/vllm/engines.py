"""Settings shared by the tests that start vLLM engines to check how kvarn is scheduled.

``ENGINE_DTYPE``: the model dtype of those engines. Scheduling, prefix caching, preemption, chunking
and batch invariance do not depend on the model's dtype, and vLLM's CPU backend runs a bfloat16
linear layer through oneDNN only where the CPU has AVX-512 BF16; elsewhere it falls back to torch,
several times slower than float32 (docs/testing.md). The tests whose claims are about the served 16-bit figures (capacity
against the 16-bit cache, accuracy against the harness: test_e2e, test_pages) keep the model's own
bfloat16; kvarn's bfloat16 kernels are checked against the reference codec in tests/kernels.
"""

from __future__ import annotations

ENGINE_DTYPE = "float32"
