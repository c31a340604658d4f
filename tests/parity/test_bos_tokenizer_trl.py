"""TRL 1.16 as the oracle for plain-text rows with a tokenizer that adds a BOS to text (as Llama's,
Mistral's and Gemma's do): TRL's SFT, DPO and KTO trainers tokenize plain text as ``tokenizer(text)``,
so every sequence starts with that BOS. One step of each gives TRL's loss, gradient norm and token count
(fastalign left the BOS out before: DPO's loss 0.797 against TRL's 0.767 on these rows)."""

from __future__ import annotations

import pytest
from tokenizers import processors

from fastalign.builtin import tiny_kto_rows, tiny_preference_rows, tiny_sft_rows, tiny_tokenizer
from fastalign.data.prompt_split import special_prefix
from tests.helpers import require
from tests.parity.conftest import save_models
from tests.parity.steps import both_steps

pytestmark = pytest.mark.slow


def bos_tokenizer():
    """The tiny tokenizer, adding its BOS before every text (a Llama-style post-processor)."""
    tokenizer = tiny_tokenizer()
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A",
        pair="<|bos|> $A <|bos|> $B",
        special_tokens=[("<|bos|>", tokenizer.bos_token_id)],
    )
    return tokenizer


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    return save_models(tmp_path_factory.mktemp("bos-models"), bos_tokenizer)


def test_the_prefix_is_the_tokenizers_own():
    assert special_prefix(bos_tokenizer()) == [bos_tokenizer().bos_token_id]
    assert special_prefix(tiny_tokenizer()) == []


@pytest.mark.parametrize("case", ["sft-prompt-completion", "sft-text", "dpo", "kto"])
def test_plain_text_rows_start_with_the_bos_trl_tokenizes_them_with(case, models, tmp_path):
    trl = require("trl")
    policy, reference = models
    sft_rows = tiny_sft_rows(4, seed=2)
    objective, trainer, config, rows, options = {
        "sft-prompt-completion": ("sft", trl.SFTTrainer, trl.SFTConfig, sft_rows, {}),
        "sft-text": (
            "sft",
            trl.SFTTrainer,
            trl.SFTConfig,
            [{"text": r["prompt"] + r["completion"]} for r in sft_rows],
            {},
        ),
        "dpo": ("dpo", trl.DPOTrainer, trl.DPOConfig, tiny_preference_rows(8, seed=3), {"beta": 0.1}),
        "kto": ("kto", trl.KTOTrainer, trl.KTOConfig, tiny_kto_rows(8, seed=3), {"beta": 0.1}),
    }[case]
    ref = {} if objective == "sft" else {"ref_model_name_or_path": reference}
    tokenizer = bos_tokenizer()
    ours, theirs = both_steps(objective, trainer, config, rows, tmp_path, policy, tokenizer, **ref, **options)
    assert ours["num_tokens"] == theirs["num_tokens"]
    for key in ("loss", "grad_norm"):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-5), key
