"""``ember export --to gguf`` and ``ember import gguf``: transformers' GGUF loader (no ember
imported) gives ember's logits within each type's tolerance and the same token ids; ember → GGUF
→ ember is bit-exact in f32; a GGUF converted from an HF model the way llama.cpp converts it
imports with transformers' logits; bad input is one line, exit 2, nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from ember.cli import main
from ember.errors import EmberError
from ember.export.gguf import export_gguf, import_gguf
from ember.export.hf import export_hf
from ember.run import load_run
from ember.train.trainer import train

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

# max |logit diff| vs ember fp32 allowed per --type; measured figures in docs/export.md
TOL = {"f32": 1e-5, "f16": 1e-3, "q8_0": 1e-2, "q4_0": 0.15}
TEXT = "def f(x):\n    return x + 1  # the sum\n" * 2
UNICODE = "naïve café — Grüße, 你好世界, привет мир, مرحبا, 😀🚀 ∑x² ≤ ∞; <|eos|> ½ \t\u00a0 é\u0301 🇫🇷 𝔘𝔫𝔦"
GPT2 = ["model.pos=learned", "model.norm=layernorm", "model.mlp=gelu", "model.bias=true", "model.n_kv_head=0"]
LAYOUTS = {"llama": [], "gpt2": GPT2}
GPT2_NAMES = [("ln_1", "attn_norm"), ("ln_2", "ffn_norm"), ("attn.c_attn", "attn_qkv"),
              ("attn.c_proj", "attn_output"), ("mlp.c_fc", "ffn_up"), ("mlp.c_proj", "ffn_down")]  # fmt: skip

# Runs in a fresh interpreter with no ember on the path: only transformers, gguf and torch.
HF_SIDE = """
import json, sys, torch, transformers
folder, text, unicode = sys.argv[1], sys.argv[3], sys.argv[4]
files, extra = json.loads(sys.argv[2]), json.loads(sys.argv[5])
out = {}
for name in files:
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    split = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name, split_special_tokens=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **extra).eval()
    ids = tok(text).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    out[name] = {"class": type(model).__name__, "ids": ids, "logits": logits.tolist(),
                 "unicode_ids": tok(unicode).input_ids, "split_ids": split(unicode).input_ids,
                 "chat_template": tok.chat_template, "eos": tok.eos_token}
assert not any(m.startswith("ember") for m in sys.modules)
print(json.dumps(out))
"""


@pytest.fixture(scope="module", params=list(LAYOUTS))
def run(request, tiny_data, tmp_path_factory):
    from ember.config import load_config

    out = tmp_path_factory.mktemp("runs")
    overrides = [f"data.dir={tiny_data}", "data.val_fraction=0.1", f"run.out_dir={out}", "train.device=cpu"]
    train(load_config("tiny", [*overrides, "train.max_steps=12", *LAYOUTS[request.param]]))
    return out / "tiny"


def _transformers_side(folder, names, extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", HF_SIDE, str(folder), json.dumps(names), TEXT, UNICODE, json.dumps(extra)],
        capture_output=True, text=True, cwd=folder, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_transformers_loads_each_type_without_ember(run, tmp_path):
    names = [f"m-{kind}.gguf" for kind in TOL]
    for kind, name in zip(TOL, names, strict=True):
        assert main(["export", str(run), "--to", "gguf", str(tmp_path / name), "--type", kind]) == 0
    model, tokenizer = load_run(run)
    # transformers 5 reads gpt2.context_length into n_ctx, which GPT2Config ignores (its table is
    # n_positions, default 1024): a GPT-2 GGUF of another context needs it passed (docs/export.md)
    extra = {"n_positions": model.cfg.max_seq_len} if model.cfg.pos == "learned" else {}
    hf = _transformers_side(tmp_path, names, extra)
    expected_class = "GPT2LMHeadModel" if model.cfg.pos == "learned" else "LlamaForCausalLM"
    diffs = {}
    for kind, name in zip(TOL, names, strict=True):
        got = hf[name]
        assert got["class"] == expected_class
        assert got["ids"] == tokenizer.encode(TEXT)
        # transformers matches a literal "<|eos|>" as the special token unless told otherwise;
        # with split_special_tokens=True it encodes as ember does (docs/export.md)
        assert got["split_ids"] == tokenizer.encode(UNICODE)
        assert got["unicode_ids"] != got["split_ids"] and tokenizer.eos_id in got["unicode_ids"]
        assert got["eos"] == "<|eos|>" and got["chat_template"].startswith("{% for message")
        with torch.no_grad():
            ours = model(torch.tensor([got["ids"]]))[0]
        diffs[kind] = (torch.tensor(got["logits"]) - ours).abs().max().item()
    print(
        f"max |logit diff| vs ember fp32 ({expected_class}, largest |logit| {ours.abs().max():.2f}): {diffs}"
    )
    for kind, diff in diffs.items():
        assert diff <= TOL[kind], (kind, diff)
    assert diffs["f16"] > 0 and diffs["q4_0"] > diffs["q8_0"]  # the types really differ


def test_llama_cpp_itself_continues_as_ember(run, tmp_path):
    """llama.cpp (llama-cpp-python, the ``llama`` extra) loads the f32 file, tokenizes as ember
    does and continues ember's prompt ids greedily with ember's ids (benchmarks/gguf.py: 5
    prompts, 32 tokens, and the decode speed of both)."""
    import itertools

    from ember.infer.engine import Engine
    from ember.infer.sampling import Sampling

    why = "llama-cpp-python is not installed: pip install -e '.[llama]' (it builds llama.cpp from source)"
    llama_cpp = pytest.importorskip("llama_cpp", reason=why)
    path = export_gguf(run, tmp_path / "m.gguf")
    engine = Engine.from_run(run)
    llm = llama_cpp.Llama(str(path), n_ctx=engine.model.cfg.max_seq_len, n_threads=1, verbose=False)
    for text in (TEXT, "naïve café — 你好 😀\n"):
        ids = engine.tokenizer.encode(text)
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids
        [want] = engine.generate([ids], Sampling(max_new_tokens=16, temperature=0, ignore_eos=True))
        llm.reset()
        greedy = llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0)
        assert list(itertools.islice(greedy, 16)) == want.token_ids


def test_quantized_types_are_written_as_asked(run, tmp_path):
    sizes = {}
    for kind in TOL:
        export_gguf(run, tmp_path / f"{kind}.gguf", kind)
        sizes[kind] = (tmp_path / f"{kind}.gguf").stat().st_size
        reader = gguf.GGUFReader(tmp_path / f"{kind}.gguf")
        types = {t.name: t.tensor_type.name for t in reader.tensors}
        assert types["token_embd.weight"] == kind.upper()
        assert types["output_norm.weight"] == "F32"  # norms stay f32, as llama.cpp writes them
        ffn_down = types["blk.0.ffn_down.weight"]  # rows of mlp_hidden: 4 * 64 (gpt2), 192 (llama)
        assert ffn_down == (kind.upper() if kind != "f32" else "F32")
    assert sizes["f32"] > sizes["f16"] > sizes["q8_0"] > sizes["q4_0"]


def test_a_row_not_a_whole_number_of_blocks_falls_back_to_f16(tiny_cfg, tmp_path):
    train(tiny_cfg("train.max_steps=1", "model.mlp_hidden=80"))  # ffn_down rows of 80: 2.5 blocks
    run = tmp_path / "runs" / "tiny"
    export_gguf(run, tmp_path / "m.gguf", "q4_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert types["blk.0.ffn_down.weight"] == "F16" and types["blk.0.ffn_up.weight"] == "Q4_0"


def test_round_trip_is_bit_exact_and_the_import_is_a_run(run, tmp_path, capsys):
    path, back = tmp_path / "m.gguf", tmp_path / "runs" / "back"
    export_gguf(run, path)
    assert main(["import", "gguf", str(path), "--out", str(back)]) == 0
    (model, tokenizer), (model2, tokenizer2) = load_run(run), load_run(back)
    assert tokenizer2.to_str() == tokenizer.to_str()
    assert model2.state_dict().keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(model2.state_dict()[name], value), name
    fields = ("n_layer", "n_head", "d_model", "max_seq_len", "pos", "norm", "mlp", "norm_eps", "rope_theta")
    for field in (*fields, "tie_embeddings", "bias", "vocab_size"):
        assert getattr(model2.cfg, field) == getattr(model.cfg, field), field
    assert (model2.cfg.n_kv_head or model2.cfg.n_head) == (model.cfg.n_kv_head or model.cfg.n_head)
    capsys.readouterr()
    assert (
        main(["generate", str(back), "--prompt", "def ", "--max-new-tokens", "4", "--temperature", "0"]) == 0
    )
    assert capsys.readouterr().out.startswith("---\ndef ")
    export_gguf(run, tmp_path / "q.gguf", "q8_0")  # a quantized file imports dequantized
    import_gguf(tmp_path / "q.gguf", tmp_path / "runs" / "q")
    idx = torch.tensor([tokenizer.encode(TEXT)])
    with torch.no_grad():
        diff = (load_run(tmp_path / "runs" / "q")[0](idx) - model(idx)).abs().max().item()
    assert 0 < diff <= TOL["q8_0"]


def test_the_card_summary_is_in_the_metadata(run, tmp_path):
    from ember.run import record_eval

    record_eval(run, {"test": {"bpb": 4.5, "ppl": 250.0, "documents": 5, "tokens": 100, "bytes": 200}})
    export_gguf(run, tmp_path / "m.gguf")
    fields = gguf.GGUFReader(tmp_path / "m.gguf").fields
    model, _ = load_run(run)
    assert fields["general.name"].contents() == "tiny"
    assert fields["general.parameter_count"].contents() == model.num_params()
    assert fields["general.dataset.0.name"].contents() == "embedded:python-docs"
    assert fields["general.test_bits_per_byte"].contents() == pytest.approx(4.5)
    assert "4.5000 bits/byte over 5 documents" in fields["general.description"].contents()


# ------------------------------------------------------------------ a GGUF llama.cpp would write


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute, written out here independently of ember
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _convert(hf, tokenizer_json: dict, path) -> None:
    """An HF GPT-2 or Llama model to GGUF with the names and layout llama.cpp's converter uses."""
    c, sd = hf.config, {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    arch = c.model_type
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("converted")
    names = gguf.TENSOR_NAMES
    tensors = {}
    if arch == "gpt2":
        w.add_context_length(c.n_positions), w.add_embedding_length(c.n_embd), w.add_block_count(c.n_layer)
        w.add_feed_forward_length(4 * c.n_embd), w.add_head_count(c.n_head)
        w.add_layer_norm_eps(c.layer_norm_epsilon)
        for k, v in sd.items():
            if k.endswith((".attn.bias", ".attn.masked_bias")):  # causal-mask buffers
                continue
            if k.endswith(".weight") and any(s in k for s in ("c_attn", "c_proj", "c_fc")):
                v = v.T  # Conv1D (in, out) to (out, in)
            k = k.replace("transformer.", "").replace(
                "lm_head", "output"
            )  # the converter writes it even tied
            k = k.replace("wte", "token_embd").replace("wpe", "position_embd").replace("ln_f", "output_norm")
            for a, b in GPT2_NAMES:
                k = k.replace(a, b)
            tensors[k.replace("h.", "blk.", 1) if k.startswith("h.") else k] = v
    else:
        w.add_context_length(c.max_position_embeddings), w.add_embedding_length(c.hidden_size)
        w.add_block_count(c.num_hidden_layers), w.add_feed_forward_length(c.intermediate_size)
        w.add_head_count(c.num_attention_heads), w.add_head_count_kv(c.num_key_value_heads)
        w.add_layer_norm_rms_eps(c.rms_norm_eps), w.add_rope_freq_base(10000.0)
        w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads), w.add_vocab_size(c.vocab_size)
        rename = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                  "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                  "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                  "post_attention_layernorm": "ffn_norm"}  # fmt: skip
        for k, v in sd.items():
            if "q_proj" in k:
                v = _permute(v, c.num_attention_heads)
            if "k_proj" in k:
                v = _permute(v, c.num_key_value_heads)
            k = k.replace("model.embed_tokens", "token_embd").replace("model.norm", "output_norm")
            k = k.replace("lm_head", "output").replace("model.layers.", "blk.")
            for a, b in rename.items():
                k = k.replace(a, b)
            tensors[k] = v
    assert set(tensors) <= {
        n.format(bid=i) + s for n in names.values() for i in range(4) for s in (".weight", ".bias")
    }
    model = tokenizer_json["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    added = {t["content"] for t in tokenizer_json["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("gpt-2"), w.add_token_list(tokens)
    w.add_token_types([3 if t in added else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    w.add_bos_token_id(0), w.add_eos_token_id(1)
    for k, v in tensors.items():
        w.add_tensor(k, np.ascontiguousarray(v))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


@pytest.mark.parametrize(
    "make",
    [
        lambda: transformers.GPT2Config(vocab_size=512, n_positions=48, n_embd=32, n_layer=2, n_head=4,
                                        initializer_range=0.2, bos_token_id=0, eos_token_id=1),
        lambda: transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=48, initializer_range=0.2,
                                         tie_word_embeddings=False),
    ],
    ids=["gpt2", "llama"],
)  # fmt: skip
def test_import_a_gguf_converted_from_transformers(run, tmp_path, make):
    export_hf(run, tmp_path / "tok")  # for its tokenizer: byte-level BPE, ember's specials at 0..15
    hf = transformers.AutoModelForCausalLM.from_config(make()).eval()
    _convert(hf, json.loads((tmp_path / "tok" / "tokenizer.json").read_text()), tmp_path / "c.gguf")
    import_gguf(tmp_path / "c.gguf", tmp_path / "imported")
    model, tokenizer = load_run(tmp_path / "imported")
    assert tokenizer.encode(UNICODE) == load_run(run)[1].encode(UNICODE)
    idx = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(idx).logits
    assert theirs.abs().max() > 1.0
    assert (model(idx) - theirs).abs().max() <= 1e-5


def _fails(capsys, argv) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ember: error: ") and err.count("\n") == 1, err
    return err


def test_bad_input_is_one_line_and_writes_nothing(run, tmp_path, capsys):
    target = tmp_path / "out" / "m.gguf"
    assert "--to gguf" in _fails(capsys, ["export", str(run), "--to", "hf", str(target), "--type", "q8_0"])
    with pytest.raises(EmberError, match="'q5_k'"):
        export_gguf(run, target, "q5_k")
    target.parent.mkdir()
    target.write_text("mine")
    for force in ([], ["--force"]):  # a file ember did not write is never replaced
        assert "m.gguf" in _fails(capsys, ["export", str(run), "--to", "gguf", str(target), *force])
    assert target.read_text() == "mine"
    target.unlink()
    assert main(["export", str(run), "--to", "gguf", str(target)]) == 0
    assert "--force" in _fails(capsys, ["export", str(run), "--to", "gguf", str(target)])
    assert main(["export", str(run), "--to", "gguf", str(target), "--type", "f16", "--force"]) == 0
    assert sorted(p.name for p in target.parent.iterdir()) == ["m.gguf"]  # no staging left
    back = tmp_path / "back"
    assert "not found" in _fails(capsys, ["import", "gguf", str(tmp_path / "none.gguf"), "--out", str(back)])
    (tmp_path / "junk.gguf").write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    assert "not a readable GGUF" in _fails(
        capsys, ["import", "gguf", str(tmp_path / "junk.gguf"), "--out", str(back)]
    )
    assert not back.exists()


def test_a_layout_or_tokenizer_gguf_cannot_hold_is_named(tiny_cfg, tmp_path, capsys):
    train(tiny_cfg("train.max_steps=1", "model.qk_norm=true"))
    run, out = tmp_path / "runs" / "tiny", tmp_path / "m.gguf"
    assert "qk_norm" in _fails(capsys, ["export", str(run), "--to", "gguf", str(out)])
    train(tiny_cfg("train.max_steps=1", "model.bias=true", "run.name=biased"))
    assert "model.bias=true" in _fails(
        capsys, ["export", str(tmp_path / "runs" / "biased"), "--to", "gguf", str(out)]
    )
    assert not out.exists()


def test_a_char_tokenizer_is_refused_by_name(run, tmp_path):
    import shutil

    from ember.data.tokenizer import Tokenizer

    copy = tmp_path / "char-run"
    shutil.copytree(run, copy)
    char = Tokenizer.train_char(["def f(x): return x"], 512)  # no byte-level form for GGUF's "gpt2"
    for path in (copy / "tokenizer.json", copy / "model" / "tokenizer.json"):
        path.write_text(char.to_str())
    with pytest.raises(EmberError, match="byte-level BPE.*'char'"):
        export_gguf(copy, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def test_a_run_with_a_stock_gpt2_tokenizer_goes_through_gguf(tmp_path):
    """A foreign byte-level BPE (GPT-2's layout: <|endoftext|> last, as bos, eos and unk; no
    pad) keeps its ids and specials through ember → GGUF → transformers and → ember."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from ember.export.hf import import_hf

    eot = "<|endoftext|>"
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=399, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([topics[k] for k in sorted(topics)[:6]] + [UNICODE], trainer)
    tok.add_special_tokens([eot])
    hf_tok = transformers.GPT2TokenizerFast(tokenizer_object=tok, bos_token=eot, eos_token=eot, unk_token=eot)
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=400, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                     initializer_range=0.2, bos_token_id=399, eos_token_id=399)  # fmt: skip
    hf = transformers.GPT2LMHeadModel(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    hf_tok.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "run")
    export_gguf(tmp_path / "run", tmp_path / "m.gguf")
    got = _transformers_side(tmp_path, ["m.gguf"], {"n_positions": 64})["m.gguf"]
    assert got["split_ids"] == hf_tok(UNICODE, add_special_tokens=False).input_ids
    assert got["eos"] == eot and got["chat_template"] is None  # no ember chat tokens in this vocabulary
    with torch.no_grad():
        theirs = hf(torch.tensor([got["ids"]])).logits[0]
    assert (torch.tensor(got["logits"]) - theirs).abs().max() <= TOL["f32"]
    import_gguf(tmp_path / "m.gguf", tmp_path / "back")
    (model, tokenizer), (model2, tokenizer2) = load_run(tmp_path / "run"), load_run(tmp_path / "back")
    assert tokenizer2.encode(UNICODE) == tokenizer.encode(UNICODE)
    assert (
        tokenizer2.special_tokens()
        == tokenizer.special_tokens()
        == {"bos": eot, "eos": eot, "pad": eot, "unk": eot}
    )
    for name, value in model.state_dict().items():
        assert torch.equal(model2.state_dict()[name], value), name
