"""Next-token sampling: penalties, logit bias, temperature, top-k, top-p, min-p, seeded draws.

Order of operations (as in transformers' logits processors): repetition penalty, presence and
frequency penalties, logit bias, then greedy argmax or temperature -> top-k -> top-p -> min-p -> draw.
Definitions:
- repetition (transformers/CTRL): for each token already seen (prompt or output), a positive
  logit is divided by the penalty, a negative one multiplied by it;
- presence / frequency (OpenAI): `logit -= presence * [count > 0] + frequency * count`, counting
  the output tokens in `history`;
- top-k keeps the k largest logits (0: off; -1, vLLM's spelling of off, is read as 0); top-p keeps
  the smallest set of most likely tokens whose probability reaches p; min-p keeps tokens whose
  probability is at least `min_p * p_max`;
- logit bias (OpenAI): `logit[id] += bias` for each (token id, bias in [-100, 100]) pair given,
  greedy included (+100 all but forces a token, -100 all but forbids it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ninfer_offload.errors import NinferError


# The range of values the sampler takes: within it, its float32 arithmetic on model logits stays finite.
MIN_TEMPERATURE = 1e-5
PENALTY_LIMIT = 2.0  # presence and frequency penalties, OpenAI's range
REPETITION_PENALTY_RANGE = (0.01, 100.0)
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range


class SamplingError(NinferError):
    """A sampling value outside what the sampler can use; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _within(value: Any, low: float, high: float) -> bool:
    """A real number (not bool) in [low, high]; NaN and infinities never are."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value) and low <= value <= high
    except OverflowError:  # an int too large for a float
        return False


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. `temperature == 0` or `greedy` means argmax.

    Every field is checked at construction against the rules below (`SamplingError` names the
    field); they are the only definition of valid sampling values, shared by `ninfer generate`
    and the server."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    greedy: bool = False

    def __post_init__(self) -> None:
        low, high = REPETITION_PENALTY_RANGE
        checks = (
            (
                "temperature",
                self.temperature == 0 or _within(self.temperature, MIN_TEMPERATURE, math.inf),
                f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}",
            ),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be an integer >= 0 (0 or -1 disables it)"),
            ("top_p", _within(self.top_p, 0.0, 1.0) and self.top_p > 0, "top_p must be in (0, 1]"),
            ("min_p", _within(self.min_p, 0.0, 1.0), "min_p must be in [0, 1]"),
            ("presence_penalty", _within(self.presence_penalty, -PENALTY_LIMIT, PENALTY_LIMIT), "presence_penalty must be in [-2, 2]"),
            ("frequency_penalty", _within(self.frequency_penalty, -PENALTY_LIMIT, PENALTY_LIMIT), "frequency_penalty must be in [-2, 2]"),
            ("repetition_penalty", _within(self.repetition_penalty, low, high), f"repetition_penalty must be in [{low:g}, {high:g}]"),
            (
                "seed",
                self.seed is None or (isinstance(self.seed, int) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]),
                "seed must be an integer in [-2**63, 2**64)",
            ),
            (
                "logit_bias",
                all(
                    isinstance(token, int) and not isinstance(token, bool) and token >= 0
                    and _within(bias, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)
                    for token, bias in self.logit_bias
                ),
                "logit_bias must map token ids (integers >= 0) to biases in [-100, 100]",
            ),
        )
        for param, ok, message in checks:
            if not ok:
                raise SamplingError(param, message)

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0

    @property
    def picks_argmax(self) -> bool:
        """Whether the next token is the argmax of the logits as they come (greedy, no penalties or bias)."""
        return self.is_greedy and not self.adjusts_logits

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits change before the pick (penalties on the tokens seen so far, a logit bias)."""
        penalized = self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)
        return penalized or bool(self.logit_bias)


TOP_K_OFF = -1  # vLLM's top_k for "off", read as 0 (this sampler's and transformers' off)
_CONFIG_DEFAULTS = {"temperature": float, "top_k": int, "top_p": float, "min_p": float, "repetition_penalty": float}


def sampling_from_config(generation_config: Mapping[str, Any], greedy: bool = False, **given: Any) -> SamplingParams:
    """SamplingParams from the values `given` (None = unset), else the model's generation_config.json
    values, else the SamplingParams defaults. `do_sample: false` there means greedy unless a
    temperature is given; a top_k of -1 means off, as 0 does."""
    try:
        values = {name: kind(generation_config[name]) for name, kind in _CONFIG_DEFAULTS.items() if generation_config.get(name) is not None}
    except (TypeError, ValueError):
        raise NinferError("generation_config.json holds a sampling value of the wrong type") from None
    values.update({name: value for name, value in given.items() if value is not None})
    if values.get("top_k") == TOP_K_OFF:
        values["top_k"] = 0
    greedy = greedy or (generation_config.get("do_sample") is False and given.get("temperature") is None)
    return SamplingParams(**values, greedy=greedy)


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, history: Sequence[int], prompt: Sequence[int] = ()
) -> torch.Tensor:
    """Float32 logits after the repetition, presence and frequency penalties and the logit bias (a new
    tensor; a biased id outside the vocabulary is a NinferError)."""
    logits = logits.detach().to(torch.float32).clone()
    vocab = logits.shape[-1]
    if params.repetition_penalty != 1.0 and (history or prompt):
        seen = torch.tensor(sorted(set(prompt) | set(history)), dtype=torch.long, device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and history:
        ids = torch.tensor(list(history), dtype=torch.long, device=logits.device)
        counts = torch.bincount(ids, minlength=vocab)[:vocab].to(torch.float32)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(torch.float32)
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias)
        if max(ids) >= vocab:
            raise NinferError(f"logit_bias names token id {max(ids)}, outside the vocabulary of {vocab}")
        logits[torch.tensor(ids, device=logits.device)] += torch.tensor(biases, dtype=torch.float32, device=logits.device)
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits with the tokens outside top-k / top-p / min-p set to -inf."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop = torch.zeros_like(logits, dtype=torch.bool)
        drop[order] = mass_before >= params.top_p
        logits = logits.masked_fill(drop, -math.inf)
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), -math.inf)
    return logits


class Sampler:
    """Draws next tokens for one sequence. With a seed, the draws are the same on every run (on
    the same device); the generator lives on the logits' device and is created at the first draw."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self._generator: torch.Generator | None = None

    def _generator_for(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            if self.params.seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(self.params.seed)
        return self._generator

    def probabilities(self, logits: torch.Tensor, history: Sequence[int], prompt: Sequence[int] = ()) -> torch.Tensor:
        """The distribution the next token is drawn from (one-hot at the argmax when greedy)."""
        logits = apply_penalties(logits, self.params, history, prompt)
        if self.params.is_greedy:
            return torch.nn.functional.one_hot(torch.argmax(logits), logits.shape[-1]).to(torch.float32)
        return torch.softmax(filter_logits(logits, self.params), dim=-1)

    def draw(self, probs: torch.Tensor) -> int:
        """A token id drawn from the distribution `probs` [vocab] (its argmax when greedy)."""
        if self.params.is_greedy:
            return int(torch.argmax(probs))
        return int(torch.multinomial(probs, 1, generator=self._generator_for(probs.device)))

    def uniform(self, device: torch.device) -> float:
        """A uniform draw in [0, 1) from the same generator (0 when greedy: nothing random is drawn)."""
        if self.params.is_greedy:
            return 0.0
        return float(torch.rand((), device=device, generator=self._generator_for(device)))

    def sample(self, logits: torch.Tensor, history: Sequence[int], prompt: Sequence[int] = ()) -> int:
        """Next token id from `logits` [vocab]; `history` = output tokens so far, `prompt` = prompt
        tokens (they count for the repetition penalty only)."""
        if logits.dim() != 1:
            raise ValueError(f"sample expects logits of shape [vocab], got {tuple(logits.shape)}")
        if self.params.is_greedy:
            return int(torch.argmax(apply_penalties(logits, self.params, history, prompt)))
        return self.draw(self.probabilities(logits, history, prompt))
