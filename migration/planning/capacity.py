"""A serving engine's steady state, as vLLM (V1), SGLang and TensorRT-LLM run one: continuous batching
with chunked prefill and a paged KV cache. Arithmetic only; the seconds and bytes it combines come from
programs compiled for the target (planning/serving.py).

The engine modelled:

- every step runs one decode token for each running sequence and, in what is left of a token budget
  of `chunk` tokens a step (decode tokens count in it, vLLM's `max_num_batched_tokens`), chunks of
  waiting prompts, first come first served;
- the KV cache is a pool of pages: a running sequence holds the pages of its prompt and of what it has
  generated. Admission here reserves each sequence's full length (prompt + generation), so that no
  running sequence is ever preempted; the concurrency is what the pool holds on those terms (vLLM's
  "maximum concurrency for N tokens per request" at start-up), less than an engine admitting
  optimistically reaches for a while, more than it sustains once it preempts;
- a request mix: classes of (share of requests, prompt tokens, generated tokens). In the steady state
  the running sequences of a class are in proportion to its share times its generation (a request runs
  for as many steps as it generates tokens), and each step must prefill the prompts of the requests its
  outputs finish: concurrency x (prompt tokens per generated token) prompt tokens a step.

Not modelled: arrivals' randomness (queueing delay: the TTFT is a prompt's own prefill at the
concurrency, with no queue), prefix caching, speculative decoding, and the engine's host overhead
between steps.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class RequestClass:
    share: float  # of the requests, the mix's shares summing to 1
    prompt: int  # tokens
    gen: int  # tokens generated


@dataclasses.dataclass(frozen=True)
class MixFigures:
    """What the engine's arithmetic needs of a mix, each averaged over the running sequences (a class
    weighted by share x generation) or over the requests (by share)."""
    tokens_held: float  # pages a running sequence holds, at its full length: prompt + generation
    context_read: float  # positions a decode step reads per running sequence: prompt + half the generation
    prompt_per_output: float  # prompt tokens to prefill per generated token
    mean_prompt: float
    mean_gen: float
    longest: int  # the longest prompt + generation of any class: the context it needs


def mix_figures(mix: tuple[RequestClass, ...]) -> MixFigures:
    running = sum(c.share * c.gen for c in mix)
    mean_gen = sum(c.share * c.gen for c in mix)
    mean_prompt = sum(c.share * c.prompt for c in mix)
    return MixFigures(tokens_held=sum(c.share * c.gen * (c.prompt + c.gen) for c in mix) / running,
                      context_read=sum(c.share * c.gen * (c.prompt + c.gen / 2) for c in mix) / running,
                      prompt_per_output=mean_prompt / mean_gen, mean_prompt=mean_prompt, mean_gen=mean_gen,
                      longest=max(c.prompt + c.gen for c in mix))


def kv_bound_concurrency(free_bytes: float, kv_bytes_per_token: float, tokens_held: float) -> int:
    """Running sequences the KV pool holds: the memory left after weights and workspace, over a
    sequence's full-length pages."""
    if free_bytes <= 0:
        return 0
    return whole_count(free_bytes, kv_bytes_per_token * tokens_held)


def budget_bound_concurrency(chunk: int, prompt_per_output: float) -> int:
    """Running sequences a step's token budget sustains: each step n decode tokens and n x prompt per
    output prompt tokens must fit in `chunk`."""
    return whole_count(chunk, 1 + prompt_per_output)


def whole_count(total: float, each: float) -> int:
    """The most of `each` that `total` holds. A float quotient that is a whole number in exact arithmetic can
    land just under it (1990 / (1 + 676 / 916) is 1145 exactly, 1144.9999999999998 in floats): a count one more
    than the floor is taken where it fits to within a part in 10^12."""
    n = int(total // each)
    return n + 1 if (n + 1) * each <= total * (1 + 1e-12) else n


@dataclasses.dataclass(frozen=True)
class SteadyState:
    concurrency: int
    step_s: float  # one engine step: the decode of every running sequence and its share of prefill
    prefill_tokens_per_step: float
    tpot_s: float  # time per output token of a running sequence: one step
    ttft_s: float  # a prompt's own prefill in the budget the decode tokens leave, with those steps' decodes
    output_tokens_per_s: float  # the server's (every GPU of it)
    requests_per_s: float


def steady_state(concurrency: int, decode_s: float, prefill_s_per_token: float, long_prompt_extra_s: float,
                 figures: MixFigures, chunk: int) -> SteadyState:
    """The engine's step at `concurrency` running sequences: the compiled decode step's `decode_s`, the
    prompt tokens it must prefill at `prefill_s_per_token` (a compiled chunk's time over its tokens),
    and `long_prompt_extra_s` per finished request (its prompt's chunks attending to its earlier ones).
    The TTFT is that of the mean prompt."""
    n = concurrency
    prefill_tokens = n * figures.prompt_per_output
    step = decode_s + prefill_tokens * prefill_s_per_token + n / figures.mean_gen * long_prompt_extra_s
    left = max(chunk - n, 1)  # the budget's tokens a step left for prompts
    # a prompt's own chunks: as many steps as the leftover budget takes to cover it, each with the decode
    # of the running sequences, plus the prefill of its tokens
    ttft = (math.ceil(figures.mean_prompt / left) * decode_s + figures.mean_prompt * prefill_s_per_token
            + long_prompt_extra_s)
    return SteadyState(concurrency=n, step_s=step, prefill_tokens_per_step=prefill_tokens, tpot_s=step, ttft_s=ttft,
                       output_tokens_per_s=n / step, requests_per_s=n / step / figures.mean_gen)


def chunked_attention_flops(prompt: float, chunk: int, layers: int, heads: int, head_dim: int) -> float:
    """The attention FLOPs a prompt of `prompt` tokens spends, prefilled in chunks of `chunk`, on its
    chunks attending to the chunks before them (what a single chunk's program does not do): chunk k
    reads k x chunk earlier positions, 4 x heads x head size FLOPs a query-key pair (the two products)."""
    chunks = prompt / chunk
    if chunks <= 1:
        return 0.0
    return 4.0 * heads * head_dim * layers * chunk * chunk * chunks * (chunks - 1) / 2
