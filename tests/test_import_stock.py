"""``ember import hf`` on checkpoints with stock tokenizers, made here with transformers and
``tokenizers`` (no downloads): GPT-2 style (byte-level BPE, ``<|endoftext|>`` as bos/eos/unk
at the last id, no pad) and Llama style (``<unk>``, ``<s>``, ``</s>`` at 0..2, Metaspace and
byte fallback). The imported run gives transformers' logits, token ids and greedy ids, counts
the true UTF-8 bytes of every token, evaluates, and exports back to the same model."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from ember.cli import main
from ember.data.tokenizer import SPECIALS_FILE, Tokenizer, _byte_decoder
from ember.errors import DataError, EmberError
from ember.export.hf import export_hf, import_hf
from ember.infer.engine import Engine
from ember.infer.sampling import Sampling
from ember.run import load_run

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: E402

TOL = 1e-5
EOT = "<|endoftext|>"
UNICODE = (
    "naïve café — Grüße, 你好世界, привет мир, مرحبا, 😀🚀 ∑x² ≤ ∞; ½ \t\u00a0 é\u0301 🇫🇷 𝔘𝔫𝔦 "
    "def f(x):\n    return x"
)
PROMPTS = ["The ", "def f(x):", "naïve café"]


def corpus() -> list[str]:
    """A few KB of English and code from CPython's pydoc topics, plus some Unicode."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)[:6]] + [UNICODE[:40]]


def gpt2_style(texts):
    """Byte-level BPE as GPT-2 has it: the 256 byte symbols, merges, then <|endoftext|> last."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=399, initial_alphabet=alphabet, show_progress=False)
    )
    tok.add_special_tokens([EOT])
    return transformers.GPT2TokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, unk_token=EOT)


def llama_style(texts):
    """SentencePiece-style BPE as Llama 2 has it: <unk>, <s>, </s>, the 256 <0xNN> byte tokens
    (in the vocabulary, not added tokens), then merges over ▁-marked words."""
    specials, byte_tokens = ["<unk>", "<s>", "</s>"], [f"<0x{b:02X}>" for b in range(256)]
    tok = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=520, special_tokens=specials + byte_tokens, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in specials]
    tok = HFTokenizer.from_str(json.dumps(spec))
    return transformers.LlamaTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def gpt2_model(vocab_size, eos):
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=vocab_size, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                initializer_range=0.2, bos_token_id=eos, eos_token_id=eos)
    )  # fmt: skip


def llama_model(vocab_size, eos):
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=64, initializer_range=0.2, bos_token_id=1,
                                 eos_token_id=eos, tie_word_embeddings=False)
    )  # fmt: skip


STYLES = {"gpt2": (gpt2_style, gpt2_model), "llama": (llama_style, llama_model)}


def make_eos_reachable(model, hf_tok) -> None:
    """Greedy decoding of PROMPTS[1] then ends within 4 tokens, so stopping at eos is tested:
    eos's output row becomes twice the row of the 4th token it would pick."""
    x = torch.tensor([hf_tok(PROMPTS[1], add_special_tokens=False).input_ids])
    eos = hf_tok.eos_token_id
    with torch.no_grad():
        pick = model.generate(x, max_new_tokens=4, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        head = model.get_output_embeddings().weight
        head[eos] = 2 * head[pick[0, -1]]


def save_checkpoint(style: str, out):
    make_tokenizer, make_model = STYLES[style]
    torch.manual_seed(0)
    hf_tok = make_tokenizer(corpus())
    model = make_model(len(hf_tok), hf_tok.eos_token_id).eval()
    make_eos_reachable(model, hf_tok)
    model.save_pretrained(out)
    hf_tok.save_pretrained(out)
    return model, hf_tok


@pytest.fixture(scope="module", params=list(STYLES))
def stock(request, tmp_path_factory):
    """(style, HF folder, HF model, HF tokenizer, imported run), imported through the CLI."""
    root = tmp_path_factory.mktemp(request.param)
    hf_model, hf_tok = save_checkpoint(request.param, root / "hf")
    assert main(["import", "hf", str(root / "hf"), "--out", str(root / "run")]) == 0
    return request.param, root / "hf", hf_model, hf_tok, root / "run"


def test_specials_come_from_the_folder(stock):
    style, _, _, hf_tok, run = stock
    _, tokenizer = load_run(run)
    assert tokenizer.eos_id == hf_tok.eos_token_id == (len(hf_tok) - 1 if style == "gpt2" else 2)
    assert tokenizer.bos_id == hf_tok.bos_token_id and tokenizer.unk_id == hf_tok.unk_token_id
    assert hf_tok.pad_token_id is None and tokenizer.pad_id == tokenizer.eos_id  # no pad: eos
    assert tokenizer.vocab_size == len(hf_tok)
    for folder in (run, run / "model"):
        assert json.loads((folder / SPECIALS_FILE).read_text())["eos"] == hf_tok.eos_token
    assert (run / "tokenizer.json").read_text() == (stock[1] / "tokenizer.json").read_text()


def test_logits_equal_transformers(stock):
    _, _, hf_model, hf_tok, run = stock
    model, _ = load_run(run)
    idx = torch.randint(0, len(hf_tok), (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, ours = hf_model(idx).logits, model(idx)
    diff = (ours - theirs).abs().max().item()
    print(f"max |logit diff| ember vs transformers ({stock[0]}): {diff:.3g}")
    assert theirs.abs().max() > 1.0 and diff <= TOL


def test_token_ids_equal_transformers(stock):
    _, _, _, hf_tok, run = stock
    _, tokenizer = load_run(run)
    ids = tokenizer.encode(UNICODE)
    assert ids == hf_tok(UNICODE, add_special_tokens=False).input_ids
    assert tokenizer.encode_batch([UNICODE, "x"]) == [ids, tokenizer.encode("x")]
    assert tokenizer.decode(ids) == UNICODE == hf_tok.decode(ids)
    # text cannot inject control tokens: special strings in text are plain characters
    literal = f"a {hf_tok.eos_token} b {hf_tok.bos_token}"
    assert (
        tokenizer.eos_id not in tokenizer.encode(literal)
        and tokenizer.decode(tokenizer.encode(literal)) == literal
    )


def test_token_byte_lengths_are_the_utf8_bytes(stock):
    style, _, _, hf_tok, run = stock
    _, tokenizer = load_run(run)
    lengths = tokenizer.token_byte_lengths()
    added = set(hf_tok.added_tokens_decoder)
    assert {i for i, n in enumerate(lengths) if n == 0} == added == set(hf_tok.all_special_ids)
    a = tokenizer.encode("a")  # a prefix, so that no decoder strips a token's leading space
    checked = 0
    for i in range(tokenizer.vocab_size):
        text = tokenizer.decode([*a, i])
        if i in added or "\ufffd" in text:  # part of a multi-byte character: no text of its own
            continue
        assert lengths[i] == len(text.encode()) - len(tokenizer.decode(a).encode()), tokenizer.id_to_token(i)
        checked += 1
    assert checked > 200
    if style == "gpt2":  # the byte-level alphabet, one symbol per byte, as tokenizers has it
        assert sorted(_byte_decoder()) == sorted(pre_tokenizers.ByteLevel.alphabet())
        assert sorted(_byte_decoder().values()) == list(range(256))
        bytes_of = len(UNICODE.encode())
    else:  # <0xNN> is one byte; Metaspace's prepended ▁ is one space byte
        assert [lengths[tokenizer.hf.token_to_id(f"<0x{b:02X}>")] for b in range(256)] == [1] * 256
        bytes_of = len(UNICODE.encode()) + 1
    assert sum(lengths[i] for i in tokenizer.encode(UNICODE)) == bytes_of
    assert tokenizer.token_byte_lengths(tokenizer.vocab_size + 7) == lengths + [0] * 7


def test_greedy_generation_equals_transformers(stock, capsys):
    _, _, hf_model, hf_tok, run = stock
    capsys.readouterr()
    argv = ["generate", str(run), "--temperature", "0", "--max-new-tokens", "12", "--json"]
    assert main([*argv, *(x for p in PROMPTS for x in ("--prompt", p))]) == 0
    ours = json.loads(capsys.readouterr().out)
    for prompt, completion in zip(PROMPTS, ours, strict=True):
        x = torch.tensor([hf_tok(prompt, add_special_tokens=False).input_ids])
        with torch.no_grad():
            out = hf_model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.eos_token_id,
            )  # fmt: skip
        new = out[0, x.shape[1] :].tolist()
        if hf_tok.eos_token_id in new:
            assert completion["finish_reason"] == "eos"
            new = new[: new.index(hf_tok.eos_token_id)]
        assert completion["token_ids"] == new and completion["text"] == hf_tok.decode(new)
        assert completion["prompt_tokens"] == x.shape[1]
    assert sum(len(c["token_ids"]) for c in ours) > 4
    assert ours[1]["finish_reason"] == "eos" and len(ours[1]["token_ids"]) < 4
    engine = Engine.from_run(run)  # the API reads the same run
    assert (
        engine.generate([PROMPTS[0]], Sampling(max_new_tokens=12, temperature=0))[0].token_ids
        == ours[0]["token_ids"]
    )


def test_eval_scores_text_bytes(stock, tmp_path):
    _, _, hf_model, hf_tok, run = stock
    text = tmp_path / "doc.txt"
    doc = (UNICODE + "\n") * 3
    text.write_text(doc, encoding="utf-8")
    assert main(["eval", str(run), "--data", str(text), "--seq-len", "32"]) == 0
    result = json.loads((run / "eval.json").read_text())["results"][str(text)]
    _, tokenizer = load_run(run)
    lengths = tokenizer.token_byte_lengths()
    ids = [*tokenizer.encode(doc), tokenizer.eos_id]
    assert result["bytes"] == sum(lengths[i] for i in ids[1:]) and result["tokens"] == len(ids) - 1
    assert math.isfinite(result["bpb"]) and result["bpb"] > 0
    print(f"bpb of the random {stock[0]} model on {result['bytes']} bytes: {result['bpb']:.3f}")


def test_export_back_to_hf_is_the_same_model(stock, tmp_path):
    style, _, hf_model, hf_tok, run = stock
    out = tmp_path / "hf-back"
    export_hf(run, out)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    back_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (
        back_tok(UNICODE, add_special_tokens=False).input_ids
        == hf_tok(UNICODE, add_special_tokens=False).input_ids
    )
    assert (back_tok.eos_token_id, back_tok.bos_token_id) == (hf_tok.eos_token_id, hf_tok.bos_token_id)
    assert back.generation_config.eos_token_id == hf_tok.eos_token_id
    idx = torch.randint(0, len(hf_tok), (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (back(idx).logits - hf_model(idx).logits).abs().max() <= TOL
    import_hf(out, tmp_path / "again")  # and in again: the same tokenizer and specials
    _, again = load_run(tmp_path / "again")
    assert again.special_tokens() == load_run(run)[1].special_tokens()


def test_quantized_import_keeps_its_specials(stock, tmp_path):
    from ember.export.quantize import quantize_run
    from ember.model.quant import QuantSpec

    quantize_run(stock[4], QuantSpec("int8-weight"), tmp_path / "q")
    _, tokenizer = load_run(tmp_path / "q")
    assert tokenizer.eos_id == stock[3].eos_token_id


def _fails(capsys, argv) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ember: error: ") and err.count("\n") == 1, err
    return err


def test_bad_stock_folders_are_named(stock, tmp_path, capsys):
    style, hf_dir, _, hf_tok, _ = stock
    bad, out = tmp_path / "hf", tmp_path / "run"
    shutil.copytree(hf_dir, bad)
    # a model whose embedding is smaller than the tokenizer's vocabulary
    STYLES[style][1](len(hf_tok) - 8, hf_tok.eos_token_id).save_pretrained(bad)
    assert "does not match the weights" in _fails(capsys, ["import", "hf", str(bad), "--out", str(out)])
    shutil.copytree(hf_dir, bad, dirs_exist_ok=True)
    config = json.loads((bad / "tokenizer_config.json").read_text())
    (bad / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|im_end|>"}))
    err = _fails(capsys, ["import", "hf", str(bad), "--out", str(out)])
    assert "tokenizer_config.json: eos_token='<|im_end|>' is not in" in err
    (bad / "tokenizer.json").unlink()
    assert "has no tokenizer.json" in _fails(capsys, ["import", "hf", str(bad), "--out", str(out)])
    assert not out.exists()
    # a damaged specials.json in a run is named
    run = tmp_path / "imported"
    import_hf(hf_dir, run)
    (run / "model" / SPECIALS_FILE).write_text('{"eos": "<nope>"}')
    assert f"{SPECIALS_FILE} is not valid" in _fails(capsys, ["generate", str(run), "--prompt", "a"])


def test_a_tokenizer_without_eos_is_refused():
    tok = HFTokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    with pytest.raises(DataError, match="no eos token"):
        Tokenizer(tok, {"bos": None, "eos": None})
    with pytest.raises(DataError, match="'</s>' is not in"):
        Tokenizer(tok, {"eos": "</s>"})
    with pytest.raises(EmberError, match="roles"):
        Tokenizer(tok, {"eos": "a", "sep": "b"})


def test_a_stock_tokenizer_may_name_its_eos_like_embers(tmp_path):
    """``<|eos|>`` at a stock id (not ember's 1) is a stock tokenizer's eos, not a damaged ember one."""
    from ember.export.hf import _read_tokenizer

    tok = gpt2_style(corpus())._tokenizer
    tok.add_special_tokens(["<|eos|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>"}))
    tokenizer = _read_tokenizer(tmp_path)
    assert tokenizer.eos_id == tokenizer.pad_id == tokenizer.vocab_size - 1 > 1
    assert tokenizer.bos_id == tokenizer.vocab_size - 2  # <|endoftext|>, a well-known name
    assert tokenizer.token_byte_lengths()[-2:] == [0, 0]


def test_sft_from_an_imported_run_adds_the_chat_tokens(stock, tmp_path, capsys):
    """A stock tokenizer has no chat tokens: SFT appends them, grows the embedding (and an untied
    head) with rows that start as the mean of the old ones, keeps every old logit, trains LoRA
    adapters with the new rows, and the result loads, chats and exports with the template."""
    from ember.config import load_config
    from ember.data.chat import CHAT_TOKENS, render
    from ember.train.trainer import Trainer

    style, _, hf_model, hf_tok, run = stock
    known = len(hf_tok)
    overrides = [
        "train.task=sft", f"train.init_from={run}", "sft.data=add-2", "sft.examples=64",
        f"run.out_dir={tmp_path}", "run.name=sft", "train.device=cpu", "train.max_steps=3",
        "train.seq_len=32", "train.batch_tokens=256", "train.micro_batch=8", "train.eval_every=0",
        "train.lora_rank=2", "train.lr=1e-2", "model.dropout=0.0",
    ]  # fmt: skip
    trainer = Trainer(load_config(str(run / "config.yaml"), overrides))
    out = capsys.readouterr().out
    assert "lacks the chat tokens" in out and f"grow from {known} to" in out
    tokenizer, model = trainer.tokenizer, trainer.model
    assert [tokenizer.hf.token_to_id(t) for t in CHAT_TOKENS] == list(range(known, known + 4))
    assert model.cfg.vocab_size >= known + 4 and model.cfg.vocab_size % 64 == 0
    tables = [model.tok_embeddings.weight, model.output.weight]
    hf_tables = [hf_model.get_input_embeddings().weight, hf_model.get_output_embeddings().weight]
    assert (tables[0] is tables[1]) == (style == "gpt2")  # GPT-2 ties its head, this Llama does not
    for ours, theirs in zip(tables, hf_tables, strict=True):
        mean = theirs.mean(0).expand_as(ours[known:])
        assert torch.equal(ours[:known], theirs) and torch.allclose(ours[known:], mean)
    x = torch.tensor([hf_tok(PROMPTS[1], add_special_tokens=False).input_ids])
    with torch.no_grad():
        assert torch.allclose(model(x)[..., :known], hf_model(x).logits, atol=TOL)

    start = [t.detach().clone() for t in tables]
    trainer.run()
    sft = tmp_path / "sft"
    after, tokenizer = load_run(sft)
    assert tokenizer.eos_id == hf_tok.eos_token_id and tokenizer.hf.token_to_id("<|end_turn|>") == known + 3
    assert json.loads((sft / "model" / SPECIALS_FILE).read_text())["eos"] == hf_tok.eos_token
    ids = [known + i for i in range(4)]
    for ours, first, theirs in zip(
        (after.tok_embeddings.weight, after.output.weight), start, hf_tables, strict=True
    ):
        assert not torch.equal(ours[ids], first[ids])  # the chat rows trained, the untied head's too
        assert torch.equal(ours[:known], theirs)  # no other row moved
    assert not (sft / "adapter").exists()  # a PEFT adapter on the source run would miss the new rows
    assert main(["export", str(sft), "--to", "hf", str(tmp_path / "hf")]) == 0
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    messages = [{"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "42"}]
    got = exported.apply_chat_template(messages, tokenizer_kwargs={"split_special_tokens": False})
    assert (got["input_ids"] if hasattr(got, "keys") else got) == render(tokenizer, messages)[0]
