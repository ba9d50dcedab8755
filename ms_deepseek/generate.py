"""Text generation: greedy or sampled decoding with the MLA latent KV cache.

>>> from ms_deepseek import DeepseekV2ForCausalLM
>>> from ms_deepseek.generate import generate
>>> model = DeepseekV2ForCausalLM.from_pretrained("path/to/checkpoint")
>>> result = generate(model, [1, 2, 3], max_new_tokens=8)            # greedy
>>> result.ids                                                        # prompt + new tokens
>>> generate(model, [1, 2, 3], 8, temperature=0.7, top_p=0.9, seed=0, repetition_penalty=1.3)

``use_cache=True`` (default) prefills the prompt once with the full MLA path, keeps the
compressed latent cache (:mod:`ms_deepseek.model.decode`) and runs one absorbed-weight
decode step per new token. ``use_cache=False`` is the reference: the full forward of
the whole sequence for every new token. In GRAPH_MODE the reference pads the sequence to
its final length (one compiled shape; causal attention and eval-mode dropless MoE make
the padding invisible to earlier positions); in PyNative it runs the exact prefix.

Logits processing follows HuggingFace: repetition penalty (over prompt and generated
ids, ``ms_deepseek.ops.RepetitionPenalty``), then temperature, top-k, top-p. A
temperature of 0 is greedy decoding. Generation stops at ``max_new_tokens`` or when
every row produced one of the EOS ids (the config's ``eos_token_id`` by default).
Both decoders run in the current MindSpore mode (PyNative or GRAPH_MODE).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np

from ms_deepseek.core.errors import UserError


@dataclass
class GenerationResult:
    """One prompt's generation. ``ids`` = prompt followed by the new tokens."""

    ids: List[int]
    prompt_length: int
    finish_reason: str  # "eos" or "length"
    use_cache: bool
    mode: str  # "graph" or "pynative"
    cache: Optional[dict] = None  # latent-cache figures (see model.decode.CacheFigures.as_dict)
    timings: dict = field(default_factory=dict)
    text: Optional[str] = None  # prompt + completion, filled by callers that hold a tokenizer
    completion: Optional[str] = None  # the new tokens' text

    @property
    def prompt_ids(self) -> List[int]:
        return self.ids[: self.prompt_length]

    @property
    def new_ids(self) -> List[int]:
        return self.ids[self.prompt_length :]

    def as_dict(self) -> dict:
        out = {
            "prompt_ids": self.prompt_ids,
            "ids": self.ids,
            "new_ids": self.new_ids,
            "finish_reason": self.finish_reason,
            "use_cache": self.use_cache,
            "mode": self.mode,
            "timings": self.timings,
        }
        if self.text is not None:
            out["text"], out["completion"] = self.text, self.completion
        if self.cache is not None:
            out["cache"] = self.cache
        return out


# ------------------------------------------------------------------ validation
def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise UserError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> np.ndarray:
    """Equal-length prompts of ids in [0, vocab_size) -> int32 [B, T]."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("prompt is empty: give at least one token id")
    lengths = {len(p) for p in prompts}
    if len(lengths) > 1:
        raise UserError(f"prompts in one batch must have the same length, got lengths {sorted(lengths)}")
    for b, p in enumerate(prompts):
        for t, tok in enumerate(p):
            if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)):
                raise UserError(f"prompt token {tok!r} at position {t} is not an integer id")
            if not 0 <= tok < vocab_size:
                where = f"prompt {b} position {t}" if len(prompts) > 1 else f"position {t}"
                raise UserError(
                    f"prompt token id {int(tok)} at {where} is outside the model's vocabulary [0, {vocab_size})"
                )
    return np.asarray(prompts, dtype=np.int32)


def check_length(prompt_length: int, max_new_tokens: int, cfg) -> int:
    """prompt + new tokens must fit the model's positions; returns the total length."""
    max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 1)
    total = prompt_length + max_new_tokens
    if total > cfg.max_position_embeddings:
        raise UserError(
            f"prompt length {prompt_length} + max_new_tokens {max_new_tokens} = {total} exceeds the "
            f"model's max_position_embeddings {cfg.max_position_embeddings}"
        )
    return total


def check_sampling(temperature: float, top_k: int, top_p: float, repetition_penalty: float) -> None:
    from ms_deepseek.ops.reference import check_penalty

    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not temperature >= 0
        or math.isinf(temperature)
    ):
        raise UserError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    _check_int("top_k", top_k, 0)
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise UserError(f"top_p must be in (0, 1], got {top_p!r}")
    check_penalty(repetition_penalty)


# ------------------------------------------------------------------ sampling
def process_logits(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Temperature, top-k and top-p (HuggingFace rules) on float [B, V] logits; removed entries -> -inf."""
    x = logits.astype(np.float64) / temperature
    V = x.shape[-1]
    if 0 < top_k < V:
        kth = np.sort(x, axis=-1)[:, V - top_k][:, None]  # [B, 1] k-th largest value
        x = np.where(x < kth, -np.inf, x)
    if top_p < 1.0:
        order = np.argsort(-x, axis=-1, kind="stable")  # [B, V] descending
        sorted_x = np.take_along_axis(x, order, -1)
        probs = np.exp(sorted_x - sorted_x[:, :1])
        probs /= probs.sum(-1, keepdims=True)
        before = np.cumsum(probs, -1) - probs  # mass strictly before each token
        remove_sorted = before >= top_p  # the most likely token is always kept (before == 0)
        remove = np.zeros_like(remove_sorted)
        np.put_along_axis(remove, order, remove_sorted, -1)
        x = np.where(remove, -np.inf, x)
    return x


def sample(logits: np.ndarray, rng: np.random.Generator, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Next ids [B] from float32 logits [B, V]: argmax when temperature == 0, else a draw."""
    if temperature == 0:
        return logits.argmax(-1).astype(np.int32)
    x = process_logits(logits, temperature, top_k, top_p)
    probs = np.exp(x - x.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.array([rng.choice(probs.shape[-1], p=row) for row in probs], dtype=np.int32)


# ------------------------------------------------------------------ decoding
def _mode_name() -> str:
    import mindspore as ms

    return "graph" if ms.get_context("mode") == ms.GRAPH_MODE else "pynative"


def cache_length(total: int, max_positions: int) -> int:
    """Cache rows for a sequence of ``total`` tokens: the next power of two (>= 16), at most the model's
    positions, so generations of similar length share one buffer and one compiled decode step."""
    return min(max(16, 1 << (total - 1).bit_length()), max_positions)


# In GRAPH_MODE a prompt of up to this many tokens goes through the decode step one token at a time (no
# prefill graph to compile or load: one graph per generation); a longer one through a compiled prefill.
STEPWISE_PROMPT = 64


def graph_shapes(cfg, batch_size: int, prompt_length: int, max_new_tokens: int) -> dict:
    """The shapes the compiled graphs of one generation take in GRAPH_MODE: latent-cache ``rows``
    (:func:`cache_length` of prompt + new tokens) and ``prompt_rows``, the prompt padded to the same kind
    of bucket (at most ``rows``), or 0 for a prompt fed through the decode step (:data:`STEPWISE_PROMPT`).
    Two calls with equal shapes run the same graphs, whatever their exact lengths."""
    rows = cache_length(prompt_length + max_new_tokens, cfg.max_position_embeddings)
    prompt_rows = 0 if prompt_length <= STEPWISE_PROMPT else cache_length(prompt_length, rows)
    return {"batch": batch_size, "prompt_rows": prompt_rows, "rows": rows}


class _ModelState:
    """What generation keeps per model between calls: latent-cache decoders by (batch, rows), and one
    repetition-penalty operator (in GRAPH_MODE each is compiled once and then reused)."""

    MAX_DECODERS = 4

    def __init__(self):
        self.decoders = {}
        self.penalty_op = None

    @staticmethod
    def of(model) -> "_ModelState":
        state = model.__dict__.get("_ms_deepseek_generation")
        if state is None:
            state = _ModelState()
            # object.__setattr__: a plain attribute, not a registered sub-Cell (parameter names stay as they are)
            object.__setattr__(model, "_ms_deepseek_generation", state)
        return state

    def decoder(self, model, batch_size: int, rows: int):
        from ms_deepseek.model.decode import CachedDecoder

        key = (batch_size, rows)
        if key not in self.decoders:
            while len(self.decoders) >= self.MAX_DECODERS:  # drop the oldest buffers
                self.decoders.pop(next(iter(self.decoders)))
            self.decoders[key] = CachedDecoder(model, batch_size, rows)
        return self.decoders[key]

    def penalty(self):
        if self.penalty_op is None:
            from ms_deepseek.ops import RepetitionPenalty

            self.penalty_op = RepetitionPenalty()
        return self.penalty_op


class _Penalty:
    """Repetition penalty over every id seen so far, with a static [B, rows] id buffer.

    Unused slots repeat the row's first id (duplicates do not change the result), so in
    GRAPH_MODE the operator compiles once instead of once per length.
    """

    def __init__(self, op, value: float, ids: np.ndarray, rows: int):
        self.value = float(value)
        self.op = op if self.value != 1.0 else None
        self.buffer = np.repeat(ids[:, :1], rows, axis=1).astype(np.int32)  # [B, rows]
        self.buffer[:, : ids.shape[1]] = ids
        self.length = ids.shape[1]

    def add(self, new_ids: np.ndarray) -> None:
        self.buffer[:, self.length] = new_ids
        self.length += 1

    def __call__(self, logits):
        """logits: MindSpore float32 Tensor [B, V] -> numpy [B, V]."""
        if self.op is None:
            return logits.asnumpy()
        import mindspore as ms

        return self.op(logits, ms.Tensor(self.buffer), self.value).asnumpy()


class _UncachedStep:
    """Reference decoder: the full forward of the sequence so far, logits of its last position."""

    def __init__(self, model, batch_size: int, rows: int):
        self.model = model
        self.rows = rows
        self.padded = _mode_name() == "graph"  # one static shape in graph mode
        self.ids = np.zeros((batch_size, 0), np.int32)

    def __call__(self, new_ids: np.ndarray):
        import mindspore as ms

        self.ids = np.concatenate([self.ids, new_ids.astype(np.int32)], axis=1)  # [B, t]
        t = self.ids.shape[1]
        if self.padded:
            padded = np.zeros((self.ids.shape[0], self.rows), np.int32)  # [B, rows]
            padded[:, :t] = self.ids
            logits = self.model(ms.Tensor(padded)).logits
        else:
            logits = self.model(ms.Tensor(self.ids)).logits  # [B, t, V]
        return logits[:, t - 1, :]


class _CachedStep:
    """Latent-cache decoder: the prompt, then one absorbed decode step per token.

    The prompt: in PyNative one full-attention prefill; in GRAPH_MODE (:func:`graph_shapes`) a short prompt
    token by token through the decode step (each step writes its row before any query reads it, so rows
    left by an earlier sequence stay masked until overwritten), a longer one through a prefill padded to
    ``prompt_rows``."""

    def __init__(self, decoder, prompt_rows: int):
        self.decoder = decoder
        graph = _mode_name() == "graph"
        self.stepwise = graph and prompt_rows == 0
        self.prompt_rows = prompt_rows if graph else 0
        self.position = 0

    def __call__(self, new_ids: np.ndarray):
        import mindspore as ms

        T = new_ids.shape[1]
        if self.position > 0:
            return self._decode(new_ids)
        if self.stepwise:
            for t in range(T):
                logits = self._decode(new_ids[:, t : t + 1])
            return logits
        padded = np.zeros((new_ids.shape[0], max(T, self.prompt_rows)), np.int32)  # [B, prompt_rows]
        padded[:, :T] = new_ids
        self.position = T
        return self.decoder(ms.Tensor(padded), ms.Tensor(0, ms.int32), True, ms.Tensor(T - 1, ms.int32))

    def _decode(self, new_ids: np.ndarray):
        """The absorbed path: new_ids [B, T] at positions self.position.. -> logits [B, V] of the last."""
        import mindspore as ms

        logits = self.decoder(ms.Tensor(new_ids.astype(np.int32)), ms.Tensor(self.position, ms.int32), False)
        self.position += new_ids.shape[1]
        return logits


def _timings(token_s: List[float], batch_size: int) -> dict:
    """prefill_s: time to the first new token; decode: every later token (one forward + sampling each);
    steady: without the first decode step (in graph mode that one includes compiling the step)."""
    decode = token_s[1:]
    out = {
        "new_tokens": len(token_s),
        "prefill_s": round(token_s[0], 4),
        "decode_s": round(sum(decode), 4),
        "decode_tokens_per_s": None,
        "steady_tokens_per_s": None,
    }
    if decode and sum(decode) > 0:
        out["decode_tokens_per_s"] = round(len(decode) * batch_size / sum(decode), 3)
    if len(decode) > 1 and sum(decode[1:]) > 0:
        out["steady_tokens_per_s"] = round((len(decode) - 1) * batch_size / sum(decode[1:]), 3)
    return out


def generate_batch(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: Optional[int] = None,
    repetition_penalty: float = 1.0,
    eos_ids: Optional[Iterable[int]] = None,
    use_cache: bool = True,
    progress: bool = False,
) -> List[GenerationResult]:
    """Generate for several equal-length prompts at once (one batch); see :func:`generate`."""
    cfg = model.config
    check_sampling(temperature, top_k, top_p, repetition_penalty)
    ids = check_prompts(prompts, cfg.vocab_size)
    B, T = ids.shape
    check_length(T, max_new_tokens, cfg)
    max_new_tokens = int(max_new_tokens)
    eos = set(cfg.eos_ids if eos_ids is None else (int(e) for e in eos_ids))
    if seed is not None:
        seed = _check_int("seed", seed, 0)
    rng = np.random.default_rng(seed)

    was_training = model.training
    model.set_train(False)  # eval: dropless MoE, whatever the config's capacity factor
    graph = _mode_name() == "graph"
    for layer in model.model.layers:  # each MoE layer's decode-step path for this mode
        if layer.is_moe:
            layer.mlp.set_decode_mode(graph)
    try:
        state = _ModelState.of(model)
        shapes = graph_shapes(cfg, B, T, max_new_tokens)
        rows = shapes["rows"]
        if use_cache:
            step = _CachedStep(state.decoder(model, B, rows), shapes["prompt_rows"])
        else:
            step = _UncachedStep(model, B, rows)
        penalty = _Penalty(state.penalty(), repetition_penalty, ids, rows)
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else (min(eos) if eos else 0)
        sampling = (rng, float(temperature), int(top_k), float(top_p))
        out, reason, token_s = _decode(step, penalty, ids, max_new_tokens, sampling, eos, pad, progress)
    finally:
        model.set_train(was_training)
    figures = _cache_figures(cfg, B, rows) if use_cache else None
    timings = _timings(token_s, B)
    return [
        GenerationResult(
            ids=out[b],
            prompt_length=T,
            finish_reason=reason[b],
            use_cache=use_cache,
            mode=_mode_name(),
            cache=figures,
            timings=timings,
        )
        for b in range(B)
    ]


def _decode(step, penalty, ids: np.ndarray, max_new_tokens: int, sampling, eos: set, pad: int, progress: bool):
    """The prefill then one token per step until every row is done or ``max_new_tokens``: (each row's ids,
    each row's finish reason, the wall time of each new token)."""
    from ms_deepseek.core.progress import progress_bar

    B = ids.shape[0]
    rng, temperature, top_k, top_p = sampling
    done = np.zeros(B, bool)
    reason = ["length"] * B
    out = [list(map(int, row)) for row in ids]
    token_s = []  # wall time of each new token: the forward that produced its logits + sampling
    t0 = time.perf_counter()
    logits = step(ids)  # prefill
    bar = progress_bar(total=max_new_tokens, enabled=progress, desc="generating", unit="tok", leave=False)
    for i in range(max_new_tokens):
        nxt = sample(penalty(logits), rng, temperature, top_k, top_p)
        nxt = np.where(done, pad, nxt).astype(np.int32)  # finished rows keep emitting padding
        _append_tokens(nxt, out, done, reason, eos)
        penalty.add(nxt)
        token_s.append(time.perf_counter() - t0)
        bar.update(1)
        if done.all() or i == max_new_tokens - 1:
            break
        t0 = time.perf_counter()
        logits = step(nxt.reshape(B, 1))
    bar.close()
    return out, reason, token_s


def _append_tokens(nxt: np.ndarray, out: List[List[int]], done: np.ndarray, reason: List[str], eos: set) -> None:
    """Each unfinished row takes its new token; a row that drew an end-of-sequence id is done."""
    for b in range(len(out)):
        if not done[b]:
            out[b].append(int(nxt[b]))
            if int(nxt[b]) in eos:
                done[b], reason[b] = True, "eos"


def _cache_figures(cfg, batch: int, rows: int) -> Dict[str, object]:
    """The KV cache's figures (model/decode.py) for this batch, with its buffer's rows and bytes."""
    from ms_deepseek.model.decode import cache_figures

    fig = cache_figures(cfg)
    return dict(
        fig.as_dict(), buffer_rows=rows, buffer_bytes=fig.latent_bytes_per_token * batch * rows, summary=fig.describe()
    )


def generate(
    model,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: Optional[int] = None,
    repetition_penalty: float = 1.0,
    eos_ids: Optional[Iterable[int]] = None,
    use_cache: bool = True,
    progress: bool = False,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` with ``model`` (a DeepseekV2ForCausalLM).

    temperature 0 (default) is greedy; otherwise sampling with ``top_k`` (0 = off) and ``top_p``
    (1 = off), reproducible with ``seed``. ``repetition_penalty`` (> 0; 1 = off) follows
    HuggingFace. ``eos_ids``: stop ids (default: the config's ``eos_token_id``; ``()`` never stops
    early). ``use_cache=False`` recomputes the full forward for every token (the reference path).
    Bad input raises :class:`~ms_deepseek.core.errors.UserError` before any compute.
    """
    if (
        isinstance(prompt_ids, (str, bytes))
        or not isinstance(prompt_ids, Sequence)
        and not isinstance(prompt_ids, np.ndarray)
    ):
        raise UserError(f"prompt_ids must be a list of token ids, got {type(prompt_ids).__name__}")
    return generate_batch(
        model,
        [list(prompt_ids)],
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        repetition_penalty=repetition_penalty,
        eos_ids=eos_ids,
        use_cache=use_cache,
        progress=progress,
    )[0]
