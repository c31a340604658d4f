"""Every benchmark, by the name its result files carry: the registry of ``fastalign bench``.

Each is a script that takes ``--preset cpu|gpu|quick`` (some have more), ``--providers`` and ``--out``
and writes one JSON file per run; ``fastalign bench`` runs the selected ones, each in a fresh process
(its own peak memory, no compile caches or allocator settings carried over from another benchmark).
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("kernels", "e2e")


@dataclass(frozen=True)
class Suite:
    name: str
    kind: str  # "kernels" or "e2e"
    script: str  # relative to the repository root
    summary: str
    #: The script's arguments for ``--quick``: a tiny shape that runs in seconds on any device.
    quick: tuple[str, ...] = ("--preset", "quick")

    def preset_args(self, preset: str | None, quick: bool) -> list[str]:
        return list(self.quick) if quick else ["--preset", preset or "cpu"]


SUITES = (
    Suite("linear_cross_entropy", "kernels", "benchmarks/kernels/bench_linear_cross_entropy.py",
          "fused linear cross-entropy vs eager, torch.compile, F.linear_cross_entropy, Liger, CCE"),
    Suite("rms_norm", "kernels", "benchmarks/kernels/bench_rms_norm.py", "RMSNorm vs a bandwidth floor"),
    Suite("rope", "kernels", "benchmarks/kernels/bench_rope.py", "RoPE of q and k vs a bandwidth floor"),
    Suite("swiglu", "kernels", "benchmarks/kernels/bench_swiglu.py", "SwiGLU vs a bandwidth floor"),
    Suite("grpo", "kernels", "benchmarks/kernels/bench_grpo.py", "GRPO loss head vs TRL's arithmetic, Liger"),
    Suite("preference", "kernels", "benchmarks/kernels/bench_preference.py",
          "DPO loss head vs TRL's arithmetic, Liger"),
    Suite("linear_divergence", "kernels", "benchmarks/kernels/bench_linear_divergence.py",
          "distillation head (generalized JSD) vs TRL's generalized_jsd_loss, Liger"),
    Suite("nf4", "kernels", "benchmarks/kernels/bench_nf4.py", "NF4 dequantization and the QLoRA linear"),
    Suite("e2e_patch_model", "e2e", "benchmarks/e2e/bench_patch_model.py",
          "Llama-, Granite- and Qwen3-MoE-shaped models' forward+backward (the MoE per expert path), "
          "original vs patch_model"),
    Suite("e2e_alignment_step", "e2e", "benchmarks/e2e/bench_alignment_step.py",
          "DPO and GRPO training steps through `fastalign train`"),
    Suite("e2e_ppo_step", "e2e", "benchmarks/e2e/bench_ppo_step.py",
          "PPO steps, generation vs training, separate models vs one base model under LoRA"),
    Suite("e2e_sft", "e2e", "benchmarks/e2e/bench_sft_trl.py",
          "SFT training, fastalign vs TRL's SFTTrainer", quick=("--preset", "cpu", "--smoke")),
    Suite("e2e_real_trl", "e2e", "benchmarks/e2e/bench_real_trl.py",
          "SFT, DPO (full, LoRA), KTO, GRPO on SmolLM2-135M: `fastalign train` vs TRL's trainers"),
    Suite("e2e_generation", "e2e", "benchmarks/e2e/bench_generation.py",
          "rollout generation on SmolLM2-135M: the engine vs generate and continuous batching",
          quick=("--preset", "quick")),
)  # fmt: skip
BY_NAME = {suite.name: suite for suite in SUITES}


def select(kind: str, only: list[str] | None = None) -> list[Suite]:
    """The suites of ``kind`` ("kernels", "e2e" or "all"), narrowed to the names in ``only``."""
    chosen = [suite for suite in SUITES if kind in ("all", suite.kind)]
    if not only:
        return chosen
    unknown = [name for name in only if name not in {suite.name for suite in chosen}]
    if unknown:
        names = ", ".join(suite.name for suite in chosen)
        raise ValueError(f"no {kind} benchmark named {', '.join(unknown)} (there are: {names})")
    return [suite for suite in chosen if suite.name in only]
