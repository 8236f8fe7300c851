"""Which prompts are prefilled together: the shapes of a batched prefill (`Engine.prefill_batch`), shared by the
engine's warm-up, which compiles and captures them, and the decode loop, which admits newcomers through them.

A batch of at least BATCHED_PREFILL_MIN_SEQUENCES newcomers (experts in VRAM) pads each one's next piece to one of
BATCHED_PREFILL_TOKENS tokens per sequence (`Engine.batched_prefill_piece`): per-sequence token blocks of 16, 32
and 64 with each T a multiple of 16, and 64 rows (the tiled products) or more (dequantized tiles and cuBLAS). A
piece of at most 64 tokens: the delta rule runs token by token there. Fewer newcomers are prefilled one at a time
(an eager forward costs about the same whatever its rows: docs/performance.md, Serving).
"""

BATCHED_PREFILL_TOKENS = (16, 32, 64)
BATCHED_PREFILL_MIN_SEQUENCES = 4
