"""Configuration: `ModelConfig` is derived from GGUF metadata (never hand-edited);
`EngineConfig` holds the serving shapes (slots, context, prefill chunks, KV dtype).

Both are frozen and validated in `__post_init__`; `server/__main__.py` builds them once.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")


class UnsupportedModelError(ValueError):
    """The file is a valid GGUF but describes a model this server cannot run."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    kind: str = "none"  # "none" | "linear" | "yarn" | "llama3"
    factor: float = 1.0
    original_context: int = 0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("none", "linear", "yarn", "llama3"):
            raise ValueError(f"unknown rope scaling {self.kind!r}")
        if self.factor <= 0:
            raise ValueError("rope scaling factor must be > 0")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str
    num_layers: int
    embed_dim: int  # E
    ffn_dim: int  # F
    num_heads: int  # H
    num_kv_heads: int  # K
    head_dim: int  # D (key and value)
    vocab_size: int  # V
    context_length: int
    rms_eps: float
    rope_theta: float
    rope_dim: int  # leading dims of D that are rotated
    rope_neox: bool  # True: rotate halves (neox); False: adjacent pairs (llama GGUFs)
    rope_scaling: RopeScaling = RopeScaling()
    tied_output: bool = False
    has_qkv_bias: bool = False
    has_qk_norm: bool = False
    # gemma3 specifics
    embed_scale: float = 1.0  # multiply token embeddings (gemma: sqrt(E))
    norm_weight_offset: float = 0.0  # gemma stores (w - 1): RMSNorm multiplies by (offset + w)
    has_post_norms: bool = False  # gemma3: post-attention and post-ffn norms
    activation: str = "silu"  # "silu" | "gelu_tanh"
    sliding_window: int = 0  # 0: every layer global
    sliding_window_pattern: int = 0  # gemma3: every Nth layer is global (N=6)
    rope_theta_local: float = 0.0  # gemma3 local layers
    attn_scale: float = 0.0  # 0: 1/sqrt(head_dim)
    final_logit_softcap: float = 0.0
    # llama.cpp's {arch}.pooling_type, for embeddings: "mean" (1), "last" (3); None: unset or
    # another kind (none, cls, rank)
    pooling: str | None = None

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise UnsupportedModelError(f"unsupported architecture {self.arch!r}")
        for name in ("num_layers", "embed_dim", "ffn_dim", "num_heads", "num_kv_heads", "head_dim", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ValueError(f"rope_dim {self.rope_dim} must be even and within head_dim {self.head_dim}")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"unknown activation {self.activation!r}")

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim**-0.5

    def is_global_layer(self, layer: int) -> bool:
        if not self.sliding_window:
            return True
        if not self.sliding_window_pattern:
            return False
        return (layer + 1) % self.sliding_window_pattern == 0

    @staticmethod
    def from_gguf_metadata(meta: Mapping[str, Any], tensor_names: frozenset[str]) -> "ModelConfig":
        """Derives the config from GGUF key/values (`meta`: key -> python value)."""
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r}; this server runs {', '.join(SUPPORTED_ARCHS)}"
            )

        def get(key: str, default: Any = None, required: bool = False) -> Any:
            full = f"{arch}.{key}"
            if full not in meta:
                if required:
                    raise UnsupportedModelError(f"GGUF metadata lacks {full}")
                return default
            return meta[full]

        num_heads = int(get("attention.head_count", required=True))
        embed_dim = int(get("embedding_length", required=True))
        num_kv = get("attention.head_count_kv", num_heads)
        head_dim = int(get("attention.key_length", embed_dim // num_heads))
        value_dim = int(get("attention.value_length", head_dim))
        if value_dim != head_dim:
            raise UnsupportedModelError(f"key length {head_dim} != value length {value_dim}")
        if "token_embd.weight" not in tensor_names:
            raise UnsupportedModelError("GGUF lacks token_embd.weight")
        vocab = get("vocab_size")
        if vocab is None:
            tokens = meta.get("tokenizer.ggml.tokens")
            if tokens is None:
                raise UnsupportedModelError("cannot tell the vocabulary size")
            vocab = len(tokens)

        scaling = RopeScaling()
        kind = get("rope.scaling.type", "none")
        factor = float(get("rope.scaling.factor", 1.0) or 1.0)
        if kind in ("linear", "yarn") and factor != 1.0:
            scaling = RopeScaling(
                kind=kind,
                factor=factor,
                original_context=int(get("rope.scaling.original_context_length", 0) or 0),
            )
        elif kind not in ("none", "linear", "yarn"):
            raise UnsupportedModelError(f"unsupported rope scaling type {kind!r}")
        # Llama 3.1+ GGUFs carry a rope_freqs.weight tensor instead of scaling keys; the
        # loader passes those factors to the forward pass directly.

        common = dict(
            arch=arch,
            num_layers=int(get("block_count", required=True)),
            embed_dim=embed_dim,
            ffn_dim=int(get("feed_forward_length", required=True)),
            num_heads=num_heads,
            num_kv_heads=int(num_kv),
            head_dim=head_dim,
            vocab_size=int(vocab),
            context_length=int(get("context_length", 2048)),
            rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_dim=int(get("rope.dimension_count", head_dim)),
            rope_scaling=scaling,
            tied_output="output.weight" not in tensor_names,
            pooling={1: "mean", 3: "last"}.get(int(get("pooling_type", 0) or 0)),
        )
        if arch == "llama":
            # convert_hf_to_gguf permutes q/k so llama.cpp rotates adjacent pairs (LLAMA_ROPE_TYPE_NORM).
            return ModelConfig(**common, rope_neox=False)
        if arch in ("qwen2", "qwen3"):
            return ModelConfig(
                **common,
                rope_neox=True,
                has_qkv_bias="blk.0.attn_q.bias" in tensor_names,
                has_qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            )
        # gemma3
        return ModelConfig(
            **common,
            rope_neox=True,
            has_qk_norm=True,
            embed_scale=embed_dim**0.5,
            has_post_norms=True,
            activation="gelu_tanh",
            sliding_window=int(get("attention.sliding_window", 0) or 0),
            sliding_window_pattern=6,
            rope_theta_local=10000.0,
            final_logit_softcap=float(get("final_logit_softcapping", 0.0) or 0.0),
        )


def prefill_chunks_for(budget: int, sizes: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Compiled chunk sizes that fit a prefill budget: the `sizes` (default: EngineConfig's) up to
    the budget, and the budget itself when it is smaller than the largest size."""
    sizes = EngineConfig.prefill_chunks if sizes is None else tuple(sizes)
    if budget < 1:
        raise ValueError("prefill budget must be >= 1")
    if not sizes or min(sizes) < 1:
        raise ValueError(f"prefill chunk sizes must be >= 1, got {list(sizes)}")
    return tuple(sorted({c for c in sizes if c <= budget} | {min(budget, max(sizes))}))


UNROLL_DECODE_LAYERS = ("auto", "on", "off")  # EngineConfig.unroll_decode_layers
NUMERICS = ("native", "ggml", "auto")  # EngineConfig.numerics
SPLIT_Q4_K = ("auto", "on", "off")  # EngineConfig.split_q4_k, split_q5_k, split_q6_k and split_legacy
MAX_AUTO_COMPILE_THREADS = {"cpu": 8, "gpu": 4}  # EngineConfig.compile_threads = 0, per backend


def _usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS says), not the machine's."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no sched_getaffinity (macOS)
        return os.cpu_count() or 1


# the KV cache dtypes an engine takes ("auto": on CPU f16 unless numerics are native, then f32;
# bf16 on GPU)
KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "float8_e4m3fn")

@dataclasses.dataclass(frozen=True)
class EngineConfig:
    num_slots: int = 8
    max_context: int = 4096  # per slot, prompt + generated
    prefill_budget: int = 512  # prompt tokens per engine step
    # Compiled prefill chunk sizes, ascending; a chunk runs at the smallest that holds it. The
    # middle sizes keep a short prompt from paying for 512 tokens (H200, Llama-2-7B Q4_0: a
    # 128-token prompt joining 3 streams waited 39 ms with (64, 512), 26 ms with these).
    prefill_chunks: tuple[int, ...] = (64, 128, 256, 512)
    max_queue: int = 64
    timeout_s: float = 600.0
    # "float32" | "bfloat16" | "float16" | "float8_e4m3fn" | "auto" (resolved at load,
    # scheduler.loader.resolve_kv_dtype: on CPU f16, llama.cpp's, unless numerics are native, then
    # f32; bf16 on GPU). An 8-bit float cache (fp8 e4m3, no scale: values saturate at +-448) halves
    # the bytes attention reads and the cache's memory; its keys and values carry 3 mantissa bits.
    # Its attention is not faster in proportion: on the H200 (7B, 3,900 tokens of context) 3,095
    # against bf16's 3,720 us per step with 8 busy slots, 3,297 against 2,793 with one, whose 32
    # programs each walk the whole row (bench/results, thirteenth session).
    kv_dtype: str = "float32"
    compute_dtype: str = "float32"  # activations; bf16 on GPU
    max_top_logprobs: int = 20
    # Decode steps per dispatch when no prompt is waiting (one lax.scan program; 1 = off; 0 =
    # auto: 1). On the H200 (7B Q4_0, 8 slots) two steps had given 334 / 1,330 / 2,553 tok/s at
    # 1 / 4 / 8 users against 302 / 1,216 / 2,142 with one (seventh session), but that gain was
    # the host's: each step's tokens reached it a program late (`model.runner._start_copies`).
    # Since the copies start at dispatch (twenty-fourth session: five runs of one step, four of
    # two) one step gave 397-404 / 1,552-1,567 / 2,988-3,090 tok/s and two 380-395 / 1,534-1,565
    # / 3,035-3,051, and a prompt joining 3 streams waited 13.6-16.2 ms against 15.4-20.0: one is
    # the default. On the CPU a step takes tens of ms, so a joining prompt would wait for a
    # second one.
    decode_steps_per_dispatch: int = 0
    # Programs the engine keeps queued on the device beyond the one whose outputs it is reading.
    # Two gained nothing on the H200 (7B Q4_0, twenty-fourth session: 400.0 / 1,562.8 / 3,080.9
    # tok/s against 399.9 / 1,566.6 / 3,065.9 with one): the host reads a step's tokens, plans
    # and launches the next within one program's device time. A slower host may need more. The
    # cost: a request that stops on EOS or a stop string has that many steps computed past its
    # end (discarded, never sent).
    dispatch_ahead: int = 1
    max_logit_bias: int = 300
    kernels: tuple[tuple[str, str], ...] = ()  # forced op -> impl
    # Attention reads only the cache prefix [0, bucket) that holds every active position; one
    # program is compiled per bucket. () = powers of two from 512 up to max_context.
    context_buckets: tuple[int, ...] = ()
    # Devices the model is split over (Megatron-style, model/sharding.py); 1 = one device.
    tensor_parallel: int = 1
    # The decode program's layer loop: "on" unrolls it (no while loop: the per-layer norm-vector
    # slices, loop counter and predicate copies go, and XLA fuses across layer boundaries; a 7B
    # decode step on the H200 is ~0.2 ms shorter), "off" keeps one scanned layer body (faster to
    # compile), "auto" unrolls on GPU only. Prefill always scans (its step is long).
    unroll_decode_layers: str = "auto"
    # Threads compiling the step programs at start (0 = auto: one per usable core, up to 8 on
    # the CPU and 4 on a GPU). The CPU compiles them concurrently (SmolLM2, 10 programs on 2
    # cores: 22.1 s against 25.6 s one by one). On the H200 a program's time is about a third
    # tracing and lowering (the Mosaic GPU kernels' layout inference, Python under the GIL) and
    # two thirds XLA compiling (without the GIL); 4 threads overlap them: a 7B Q4_K_M's 6
    # programs at context 512 in 57.7 s against 95.2 s, its 12 at 1024 in 151.8 against
    # 239.9 s. The programs built concurrently decoded no slower (305 / 2,397 against 285 /
    # 2,233 tok/s at 1 / 8 users) and prefilled no slower (15,831 against 15,568 tok/s, a
    # session apart); XLA's autotuner, which times kernels on the device while it compiles, had
    # been the worry. One figure went the other way in the A/B, unexplained and within the run
    # to run spread seen before: TTFT joining 3 streams 24.4 against 19.9 ms.
    compile_threads: int = 0
    # "native": each op's own arithmetic (f32 on CPU); "ggml": on the CPU, llama.cpp's x86-64
    # CPU build's rounding op by op (pallas_kernels/ggml_cpu.py), so that greedy tokens equal
    # llama.cpp's on the same file; an f16 cache; only what that build's arithmetic is
    # reproduced for (model/kernels.py says what it refuses); "auto" (the server's default):
    # ggml where it is reproduced, else native.
    numerics: str = "native"
    # numerics "ggml": the thread count of the llama.cpp run to match (its decode attention over
    # 512 or more cache cells splits them between its threads; nothing else depends on it).
    ggml_threads: int = 2
    # Decode attention planned for few busy slots (where the chosen kernel has such a plan: the
    # Triton one from 1024-key context buckets; its `few_rows_limit`: 3 of 8 for a 7B's 32 kv
    # heads, of 32 from 2048 keys, of 64 none to 2048; with GQA 2 of 8 in buckets over 2048 keys): it
    # spreads a lone long row over many programs (H100, 7B Q4_0, one busy slot: a decode step
    # 3.29 -> 2.89 ms at 1,500 tokens of context, 4.90 -> 3.36 at 3,900; 3 busy at 3,000: the
    # attention 73.4 -> 65.4 us a layer).
    # A row's output is bitwise the same under either plan (the kernel folds a row's key chunks
    # in order whichever programs hold them), so the engine stays batch-invariant. Costs a
    # compile per context bucket that has it.
    few_rows_attention: bool = True
    # Constrained decoding (scheduler/grammar.py) without a host stall: "on" splits a step that
    # waits for a constrained request's token into its forward pass, queued behind the step
    # before, and its sampling, dispatched once the host has read that token and filled the
    # allowed tokens (StepPlan.deferred), so the device runs the forward pass meanwhile; "off"
    # reads the token before planning the step (the device idles for the host's read, plan and
    # dispatch); "auto": on with a GPU and one device. Costs a compile per context bucket and one.
    constrained_overlap: str = "auto"
    # A slot's keys and values kept after its request for a later one whose prompt starts with
    # the same whole chunks (scheduler/engine.py's prompt cache): a chat's next turn prefills only
    # what follows the chunks its history shares with an earlier prompt. The tokens are those of a
    # cold prefill. Off: every request prefills its whole prompt (for A/B measurements).
    prompt_cache: bool = True
    # Prompt logprobs (PrefillChunk.score: OpenAI's echo with logprobs, vLLM's prompt_logprobs):
    # a prefill program that also scores each prompt token, compiled for every chunk size and
    # context bucket. Off: those requests are refused and the compiles saved.
    prompt_logprobs: bool = True
    # The decode step's new keys and values written by XLA scatters before the attention kernel
    # instead of by the kernel itself (where it can: the Triton one, `Kernels.decode_writes_cache`).
    # For A/B measurements: the kernel's own write saved 64 kernels and 89-97 us per step of a 7B
    # at 200 tokens of context on the H200 (bench/results, twelfth session).
    separate_kv_write: bool = False
    # x of the output and down projections (made by elementwise ops) permuted for the Mosaic GPU
    # matmul by a gather, which XLA fuses into those ops, rather than a transpose (its `gather_x`;
    # `Kernels.matmul`'s `elementwise_x`). For A/B measurements: on the H200 a Llama-3-8B Q4_0
    # step took 405 kernels with it against 469 and decoded 3-4% faster (bench/results, twentieth
    # session); on a 7B Q4_K_M (twenty-first session) neutral, within run-to-run spread.
    gather_x: bool = True
    # The value rows permuted at load into the order the output projection's matmul reads its x
    # in (model/ordered_values.py), so that the attention's output goes to it as it is: one XLA
    # kernel (the permutation, with the conversion to bf16) fewer per layer of a decode step. One
    # device only. For A/B measurements.
    ordered_values: bool = True
    # The gate/up rows interleaved at load where the decode matmul makes the gated activation in
    # its epilogue (model/gated_ffn.py): one XLA kernel (act(gate) * up, permuted for the down
    # projection) fewer per layer of a decode step. One device only. For A/B measurements.
    gated_ffn: bool = True
    # The Mosaic GPU matmuls called through `pallas_kernels.lowering_cache.LoweredOnce`: each
    # kernel lowered once per shape for all the step programs instead of once per program (on
    # the H200, 1.5 s per kernel and program, under the GIL). One device only, and a jax that can
    # export without its forward-compatibility rules (else a warning and each program lowers its
    # own). The kernels are byte for byte the direct ones (tests). On the H200 (bench/results,
    # sixteenth session) a 7B Q4_K_M's 12 step programs compiled in 82.9 s against 138.0 s
    # without it, with the same decode and prefill speeds.
    reuse_kernel_lowering: bool = True
    # The prefill programs compiled with XLA's command buffers (CUDA graphs) on a GPU, as the
    # decode ones are. Off (`--no-prefill-cuda-graphs`) XLA launches a prefill chunk's ~900
    # kernels one by one, so the device starts on the first while the host launches the rest.
    # For A/B measurements: on the H200 (bench/results, sixteenth session) a 7B Q4_0's 512-token
    # prefill ran at 23,696 tok/s with the graphs and 23,181 without, and a prompt joining 3
    # streams waited 16.2 against 16.0 ms for its first token.
    prefill_cuda_graphs: bool = True
    # After warm-up the engine thread runs a full collection and moves every object still alive
    # (the model, its compiled programs, JAX's and the tokenizer's tables) to Python's permanent
    # generation (`gc.freeze`), so that later collections scan only what requests allocate. A
    # collection holds the GIL, stalling the engine thread and the event loop alike; how long the
    # full ones take, and how often they run, shows in /metrics (`pallas_gc_pause_seconds`).
    gc_freeze: bool = True
    # The prefill programs write their output (the first token, its logprobs) into pinned host
    # memory themselves, where the device has such memory (a GPU; the CPU backend lists it too),
    # instead of the host starting its copy after the program (model/transfer.py). Not the decode
    # programs: on the H200 theirs made decode 26-30% slower. Off (`--no-host-outputs`) for A/B runs.
    host_outputs: bool = True
    # Q4_K matrices split at load into Q4_0's codes and block scales plus an offset per block and
    # row, scales and offsets in bf16 (a weight moves by at most about 2^-8 of its scaled code plus
    # 2^-8 of its block's offset: the rounding of the folded kernel's bf16 weights, which are
    # unchanged), 11% more bytes, so that Q4_0's kernels serve them: on a Hopper GPU the Mosaic matmul (its
    # kernels fold scales and offsets into bf16 weights), the Triton Q4_0 kernel where Mosaic refuses a shape.
    # "auto" splits where the Mosaic matmul serves them (one device, a Hopper GPU, the matmul not
    # forced to another implementation) or a forced jax-triton one does (`model.loader.split_formats`)
    # and the split weights fit
    # the device's memory beside the KV cache (`model.loader.splits_that_fit`): on the H200 a 7B Q4_K_M
    # decode step took 4.2 ms split against 7.6 ms through the Triton Q4_K kernel (bench/results,
    # fourteenth session).
    split_q4_k: str = "auto"
    # Q6_K matrices (N a multiple of 64) split at load into codes (6-bit or int8: q6_k_split_bits)
    # and an f16 scale per 16 weights (7% or 37% more bytes) for the Mosaic GPU matmul
    # (pallas_kernels/q6_k_split.py; of the other GPU kernels only the jax-triton variant serves
    # them, the 8-bit form only). "auto" as split_q4_k.
    split_q6_k: str = "auto"
    # The Q6_K split's codes: 6 bits ("q6_k_split6": a nibble plane and a plane of the high two
    # bits, 0.875 bytes per weight, 22% fewer than the 8-bit split's) or 8 ("q6_k_split", int8
    # codes; the jax-triton variant takes only these, and keeps them when forced).
    # pallas_kernels/q6_k_split.py. On the H200 a 7B Q4_K_M's decode step spent 1,851 against
    # 1,903 us in the Mosaic matmuls with 6 bits, its step 2.52 / 2.59 against 2.57 / 2.63 ms at 1
    # / 8 busy slots; a 7B Q4_0's (only its output matrix is Q6_K) 1,554-1,557 against
    # 1,552-1,554 us (bench/results, thirty-eighth session).
    q6_k_split_bits: int = 6
    # Q5_K matrices split at load into Q8_0's int8 codes and f16 block scales plus an f16 offset
    # per block and row (64% more bytes) for the Mosaic GPU matmul's 8-bit path, the Triton Q8_0
    # kernel where Mosaic refuses a shape (pallas_kernels/q5_k_split.py; its scales and offsets
    # rounded to f16 as split_q4_k's were until the thirty-sixth session). "auto" as split_q4_k:
    # on the H200 a 7B Q5_K_M decoded at 136 tok/s for one user through the Triton Q5_K kernel
    # (bench/results, nineteenth session).
    split_q5_k: str = "auto"
    # Q4_1, Q5_0 and Q5_1 matrices in the forms of the splits above (pallas_kernels/legacy_split.py:
    # Q5_0 as Q8_0 exactly, Q4_1 as q4_k_split's form with the same bytes, Q5_1 as q5_k_split's),
    # so that the Mosaic GPU matmul serves them rather than the Triton kernels (20-38% of copy
    # bandwidth at M = 8 on the H200, bench/results, nineteenth session), only matrices whose shape
    # the Mosaic kernel takes (`model.weights.is_split`). "auto" as split_q4_k: on the H200
    # synthetic 7B Q4_1, Q5_0 and Q5_1 files decoded 1.75-1.81x faster split than through the
    # Triton kernels, their cold start compiling for 32-53 s against 20-23 (bench/results,
    # twentieth session).
    split_legacy: str = "auto"
    # Speculative decoding by prompt lookup (model/speculative.py): the most drafts of its next
    # tokens a request checks per decode step, in the rows of the
    # padded batch that idle slots leave (so at most num_slots minus the busy slots); the drafts are
    # the tokens that followed an earlier occurrence of its last ngram_max down to
    # ngram_min tokens. The tokens are exactly those of a plain decode. 0: off. Needs a decode
    # attention that takes each row's slot (the Triton kernels, the reference), one device.
    draft_max: int = 0
    ngram_max: int = 3
    ngram_min: int = 1
    # A slot whose drafts lately gave fewer than this many accepted tokens per step (a moving
    # average) stops speculating, trying again every DRAFT_PROBE_STEPS steps; while no busy slot
    # speculates the plain decode program runs, which costs less than the speculative one (on
    # the H200 a Llama-2-7B step at 200 keys took 2.18 ms plain against 2.34 speculative with
    # 7 drafts, 7.5% more: text without repeats loses about an eighth of that). 0: every slot
    # always speculates.
    draft_min_gain: float = 0.1

    def compile_workers(self, backend: str, programs: int) -> int:
        """Threads to compile `programs` programs on `backend`, "auto" (0) resolved: the cores
        this process may use, at most MAX_AUTO_COMPILE_THREADS of the backend (each compile
        holds its own LLVM state in memory; 1 on backends not measured)."""
        wanted = self.compile_threads or min(_usable_cores(), MAX_AUTO_COMPILE_THREADS.get(backend, 1))
        return max(1, min(wanted, programs))

    def overlaps_constrained(self, backend: str) -> bool:
        """constrained_overlap resolved for a backend (one device: tensor parallel 1)."""
        if self.constrained_overlap == "auto":
            return backend == "gpu" and self.tensor_parallel == 1
        return self.constrained_overlap == "on"

    def decode_steps(self) -> int:
        """Decode steps per dispatch, "auto" (0) resolved: one on every backend."""
        return self.decode_steps_per_dispatch or 1

    def unrolls_decode(self, backend: str) -> bool:
        return self.unroll_decode_layers == "on" or (self.unroll_decode_layers == "auto" and backend == "gpu")

    @property
    def attention_buckets(self) -> tuple[int, ...]:
        if self.context_buckets:
            return self.context_buckets
        buckets, b = [], 512
        while b < self.max_context:
            buckets.append(b)
            b *= 2
        return (*buckets, self.max_context)

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError("slots must be >= 1")
        if self.max_context < 16:
            raise ValueError("max context must be >= 16")
        if not self.prefill_chunks or list(self.prefill_chunks) != sorted(set(self.prefill_chunks)):
            raise ValueError("prefill chunk sizes must be distinct and ascending")
        if self.prefill_chunks[0] < 1:
            raise ValueError("prefill chunk sizes must be >= 1")
        if self.prefill_budget < self.prefill_chunks[-1]:
            raise ValueError(
                f"prefill budget {self.prefill_budget} is below the largest chunk {self.prefill_chunks[-1]}"
            )
        if self.decode_steps_per_dispatch < 0:
            raise ValueError("decode steps per dispatch must be >= 1, or 0 for auto")
        if self.constrained_overlap not in ("auto", "on", "off"):
            raise ValueError(f"constrained_overlap must be auto, on or off, got {self.constrained_overlap!r}")
        if self.dispatch_ahead < 1:
            raise ValueError("programs dispatched ahead must be >= 1")
        if self.max_queue < 0:
            raise ValueError("max queue must be >= 0")
        if self.timeout_s <= 0:
            raise ValueError("timeout must be > 0")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"unknown KV dtype {self.kv_dtype!r}")
        if self.context_buckets and (
            list(self.context_buckets) != sorted(set(self.context_buckets))
            or self.context_buckets[-1] != self.max_context
            or self.context_buckets[0] < 1
        ):
            raise ValueError("context buckets must be distinct, ascending and end at max context")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"unknown compute dtype {self.compute_dtype!r}")
        if self.unroll_decode_layers not in UNROLL_DECODE_LAYERS:
            raise ValueError(f"unroll decode layers must be auto, on or off, got {self.unroll_decode_layers!r}")
        if {self.split_q4_k, self.split_q5_k, self.split_q6_k, self.split_legacy} - set(SPLIT_Q4_K):
            raise ValueError(f"split Q4_K / Q5_K / Q6_K / legacy must be auto, on or off, got {self.split_q4_k!r} / "
                             f"{self.split_q5_k!r} / {self.split_q6_k!r} / {self.split_legacy!r}")
        if self.q6_k_split_bits not in (6, 8):
            raise ValueError(f"the Q6_K split's code bits must be 6 or 8, got {self.q6_k_split_bits!r}")
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor parallel must be >= 1, got {self.tensor_parallel}")
        if self.numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, got {self.numerics!r}")
        if self.ggml_threads < 1:
            raise ValueError(f"ggml threads must be >= 1, got {self.ggml_threads}")
        if self.numerics == "ggml" and self.kv_dtype not in ("auto", "float16"):
            raise ValueError(f"numerics ggml keeps llama.cpp's f16 cache, not {self.kv_dtype}")
        if self.draft_max < 0 or self.draft_max >= max(self.num_slots, 2):
            raise ValueError(f"draft max must be in [0, {max(self.num_slots, 2) - 1}] (slots - 1), got {self.draft_max}")
        if not 0 <= self.draft_min_gain < float("inf"):
            raise ValueError(f"draft min gain must be a number >= 0, got {self.draft_min_gain}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {self.ngram_min} and {self.ngram_max}")
        if self.compile_threads < 0:
            raise ValueError(f"compile threads must be >= 1, or 0 for auto, got {self.compile_threads}")
