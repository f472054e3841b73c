"""Issue 20: `ask` and blend speak each model's own chat format.

Two families: the embedded SmolLM2 (ChatML template, no BOS added by its
tokenizer) and a tiny Gemma-style model built here (its own BPE tokenizer
trained on a license text, ``<start_of_turn>`` template that refuses a
system turn, BOS added by the tokenizer; random weights, so only the prompt
is checked there, not the answer's sense).
"""

from __future__ import annotations


import numpy as np
import pytest

from kvcodec.models.chat import ChatFormat
from kvcodec.runtime.knowledge import KnowledgeBase

DOC = open("/usr/share/common-licenses/Apache-2.0").read()[:600]
DOC2 = open("/usr/share/common-licenses/MPL-2.0").read()[:400]

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def _gemma_style_tokenizer(template: str | None):
    """A byte-level BPE tokenizer with Gemma's special tokens, BOS added by the tokenizer itself."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([open("/usr/share/common-licenses/GPL-3").read()], trainer)
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>",
        additional_special_tokens=["<start_of_turn>", "<end_of_turn>"],
    )
    fast.chat_template = template
    return fast


@pytest.fixture(scope="module")
def gemma_lm(tmp_path_factory):
    """The tiny second family, saved to a local HF directory and loaded like any ``--model PATH``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcodec.models.load import load_model

    d = tmp_path_factory.mktemp("gemma-style")
    tok = _gemma_style_tokenizer(GEMMA_TEMPLATE)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return load_model(str(d))


def _full_prompt(kb: KnowledgeBase, docs: list[str], question: str) -> np.ndarray:
    ids, _ = kb.context_ids(docs)
    return np.concatenate([ids, kb.question_ids(question)])


@pytest.mark.model
def test_smollm2_prompt_is_its_chat_template(lm, tmp_path):
    kb = KnowledgeBase(lm, str(tmp_path / "st"))
    assert kb.chat.templated
    ids = _full_prompt(kb, [DOC, DOC2], "What is this?")
    user = DOC.rstrip() + "\n\n" + DOC2.rstrip() + "\n\nQuestion: What is this?"
    want = lm.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Answer the question using the documents."}, {"role": "user", "content": user}],
        add_generation_prompt=True, tokenize=False,
    )
    assert lm.tokenizer.decode(ids) == want
    # ChatML spelled with its special tokens (ids), not as text pieces; SmolLM2's tokenizer adds no BOS.
    im_start = lm.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == im_start and int((ids == im_start).sum()) == 3


def test_gemma_style_prompt_has_bos_turn_markers_and_no_chatml(gemma_lm, tmp_path):
    tok = gemma_lm.tokenizer
    kb = KnowledgeBase(gemma_lm, str(tmp_path / "st"))
    ids = _full_prompt(kb, [DOC], "What is this?")
    sot, eot = tok.convert_tokens_to_ids("<start_of_turn>"), tok.convert_tokens_to_ids("<end_of_turn>")
    assert ids[0] == tok.bos_token_id and int((ids == tok.bos_token_id).sum()) == 1  # once: the template writes it, not twice
    assert int((ids == sot).sum()) == 2 and int((ids == eot).sum()) == 1
    text = tok.decode(ids)
    assert "<|im_start|>" not in text and "im_start" not in text
    # The system turn is refused by this template: its text opens the user turn instead.
    assert text == ("<bos><start_of_turn>user\nAnswer the question using the documents.\n\n" + DOC.rstrip()
                    + "\n\nQuestion: What is this?<end_of_turn>\n<start_of_turn>model\n")


def test_bos_added_when_the_template_omits_it(gemma_lm):
    tok = _gemma_style_tokenizer(GEMMA_TEMPLATE.replace("{{ bos_token }}", ""))
    fmt = ChatFormat.for_tokenizer(tok)
    assert fmt.prefix[0] == tok.bos_token_id and int((fmt.prefix == tok.bos_token_id).sum()) == 1


def test_model_without_template_gets_the_plain_format():
    tok = _gemma_style_tokenizer(None)
    fmt = ChatFormat.for_tokenizer(tok)
    assert not fmt.templated
    assert tok.decode(fmt.prefix) == "<bos>Answer the question using the documents.\n\n"
    assert tok.decode(fmt.question_ids("Why?")) == "Question: Why?\nAnswer:"


def test_gemma_style_ask_and_blend_run_on_its_prompt(gemma_lm, tmp_path):
    """The whole ask path (prefill, store, reload) and blend on the second family's prompt."""
    kb = KnowledgeBase(gemma_lm, str(tmp_path / "st"), preset="lossless")
    first = kb.ask([DOC], "What is this?", max_new_tokens=4)
    second = KnowledgeBase(gemma_lm, str(tmp_path / "st"), preset="lossless").ask([DOC], "What is this?", max_new_tokens=4)
    assert first.source == "prefill" and second.source == "store" and second.answer_ids == first.answer_ids
    assert first.context_tokens == len(kb.context_ids([DOC])[0])
    blended = kb.ask_blended([DOC, DOC2], "What is this?", max_new_tokens=2, recompute_ratio=1.0)
    assert blended.source == "blend" and len(blended.answer_ids) >= 1


@pytest.mark.model
def test_smollm2_answer_is_coherent_with_its_template(lm, tmp_path):
    """A real answer on the real model: an English sentence about the document, no turn markers parroted."""
    kb = KnowledgeBase(lm, str(tmp_path / "st"), preset="lossless")
    ans = kb.ask([DOC], "Which license is this document?", max_new_tokens=16, store_new=False)
    assert "Apache" in ans.answer and "im_start" not in ans.answer and "user" not in ans.answer.split()[:2]
