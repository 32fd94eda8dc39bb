"""``ember export --to hf`` and ``ember import hf``: transformers loads the export without ember
and gives the same logits, greedy text and token ids; the round trip is bit-exact; bad input
is one line, exit 2, nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from ember.cli import main
from ember.errors import EmberError
from ember.export.hf import export_hf, import_hf
from ember.infer.engine import Engine
from ember.infer.sampling import Sampling
from ember.model.gpt import mlp_hidden_size
from ember.run import load_run
from ember.train.trainer import train

transformers = pytest.importorskip("transformers")

TOL = 1e-5
TEXT = "def f(x):\n    return x + 1  # the sum\n"
UNICODE = "naïve café — Grüße, 你好世界, привет мир, مرحبا, 😀🚀 ∑x² ≤ ∞; <|eos|> ½ \t\u00a0 é\u0301 🇫🇷 𝔘𝔫𝔦"
PROMPTS = ["def ", "class Foo", "import os\n", "The ", "    return"]
GPT2 = ["model.pos=learned", "model.norm=layernorm", "model.mlp=gelu", "model.bias=true", "model.n_kv_head=0"]
LAYOUTS = {"llama": [], "gpt2": GPT2}

# Runs in a fresh interpreter with no ember on the path: only transformers and torch.
HF_SIDE = """
import json, sys, torch, transformers
d, text, unicode, prompts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
tok = transformers.AutoTokenizer.from_pretrained(d)
model = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
ids = tok(text).input_ids
with torch.no_grad():
    logits = model(torch.tensor([ids])).logits[0]
texts = []
for p in prompts:
    x = torch.tensor([tok(p).input_ids])
    new = model.generate(x, max_new_tokens=12, do_sample=False)[0, x.shape[1]:].tolist()
    new = new[: new.index(tok.eos_token_id)] if tok.eos_token_id in new else new
    texts.append(tok.decode(new, skip_special_tokens=False))
assert not any(m.startswith("ember") for m in sys.modules)
print(json.dumps({"class": type(model).__name__, "ids": ids, "logits": logits.tolist(),
                  "unicode_ids": tok(unicode).input_ids, "texts": texts}))
"""


@pytest.fixture(scope="module", params=list(LAYOUTS))
def run(request, tiny_data, tmp_path_factory):
    from ember.config import load_config

    out = tmp_path_factory.mktemp("runs")
    overrides = [f"data.dir={tiny_data}", "data.val_fraction=0.1", f"run.out_dir={out}", "train.device=cpu"]
    train(load_config("tiny", [*overrides, "train.max_steps=12", *LAYOUTS[request.param]]))
    return out / "tiny"


def test_transformers_loads_the_export_without_ember(run, tmp_path):
    out = tmp_path / "hf"
    assert main(["export", str(run), "--to", "hf", str(out)]) == 0
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|eos|>"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", HF_SIDE, str(out), TEXT, UNICODE, json.dumps(PROMPTS)],
        capture_output=True, text=True, cwd=tmp_path, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    hf = json.loads(proc.stdout)
    model, tokenizer = load_run(run)
    assert hf["class"] == ("GPT2LMHeadModel" if model.cfg.pos == "learned" else "LlamaForCausalLM")
    assert hf["unicode_ids"] == tokenizer.encode(UNICODE)
    assert tokenizer.decode(hf["unicode_ids"]) == UNICODE
    assert hf["ids"] == tokenizer.encode(TEXT)
    with torch.no_grad():
        ours = model(torch.tensor([hf["ids"]]))[0]
    diff = (ours - torch.tensor(hf["logits"])).abs().max().item()
    print(f"max |logit diff| ember vs transformers ({model.cfg.pos}): {diff:.3g}")
    assert ours.abs().max() > 1.0 and diff <= TOL
    engine = Engine(model, tokenizer)
    greedy = Sampling(max_new_tokens=12, temperature=0)
    assert hf["texts"] == [engine.generate([p], greedy)[0].text for p in PROMPTS]
    assert any(hf["texts"])


def test_round_trip_is_bit_exact_and_the_import_is_a_run(run, tmp_path, capsys):
    hf_dir, back = tmp_path / "hf", tmp_path / "runs" / "back"
    export_hf(run, hf_dir)
    assert main(["import", "hf", str(hf_dir), "--out", str(back)]) == 0
    (model, tokenizer), (model2, tokenizer2) = load_run(run), load_run(back)
    # HF stores the MLP width explicitly; ember's 0 means "the default width"
    assert replace(model2.cfg, mlp_hidden=0) == replace(model.cfg, mlp_hidden=0)
    assert mlp_hidden_size(model2.cfg) == mlp_hidden_size(model.cfg)
    assert tokenizer2.to_str() == tokenizer.to_str()
    assert model2.state_dict().keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(model2.state_dict()[name], value), name
    capsys.readouterr()
    assert (
        main(["generate", str(back), "--prompt", "def ", "--max-new-tokens", "4", "--temperature", "0"]) == 0
    )
    assert capsys.readouterr().out.startswith("---\ndef ")
    text = tmp_path / "t.py"
    text.write_text("def f(x):\n    return x + 1\n" * 40)
    assert main(["eval", str(back), "--data", str(text)]) == 0
    assert "manifest.json" in _fails(capsys, ["eval", str(back)])  # no prepared data to split


def _hf_checkpoint(config, tokenizer_from: str, out):
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(out)
    return model


@pytest.mark.parametrize(
    "make",
    [
        lambda: transformers.GPT2Config(vocab_size=520, n_positions=48, n_embd=32, n_layer=2, n_head=4,
                                        initializer_range=0.2, bos_token_id=0, eos_token_id=1),
        lambda: transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=80,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=48, initializer_range=0.2,
                                         tie_word_embeddings=False),
    ],
    ids=["gpt2", "llama"],
)  # fmt: skip
def test_import_a_checkpoint_made_by_transformers(run, tmp_path, make):
    hf_dir = tmp_path / "hf"
    export_hf(run, tmp_path / "tok")  # for its tokenizer: ember's specials at ids 0..15
    hf = _hf_checkpoint(make(), str(tmp_path / "tok"), hf_dir)
    import_hf(hf_dir, tmp_path / "imported")
    model, _ = load_run(tmp_path / "imported")
    idx = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(idx).logits
    assert theirs.abs().max() > 1.0
    assert (model(idx) - theirs).abs().max() <= TOL


def _bad_llama():
    return transformers.LlamaConfig(
        hidden_act="gelu", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )


def _bad_gpt2():
    return transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, scale_attn_by_inverse_layer_idx=True)


@pytest.mark.parametrize(
    "config, field", [(_bad_llama, "hidden_act"), (_bad_gpt2, "scale_attn_by_inverse_layer_idx")]
)
def test_an_architecture_ember_cannot_represent_is_named(run, tmp_path, config, field):
    export_hf(run, tmp_path / "tok")
    _hf_checkpoint(config(), str(tmp_path / "tok"), tmp_path / "hf")
    with pytest.raises(EmberError, match=field):
        import_hf(tmp_path / "hf", tmp_path / "imported")
    assert not (tmp_path / "imported").exists()


def _fails(capsys, argv) -> str:
    capsys.readouterr()  # drop what earlier calls printed (transformers' progress bars)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ember: error: ") and err.count("\n") == 1, err
    return err


def test_bad_input_is_one_line_and_writes_nothing(run, tmp_path, capsys):
    bare = tmp_path / "bare-run"
    bare.mkdir()
    target = tmp_path / "out" / "hf"
    assert "no final weights" in _fails(capsys, ["export", str(bare), "--to", "hf", str(target)])
    assert "'tflite'" in _fails(capsys, ["export", str(run), "--to", "tflite", str(target)])
    assert not target.exists()
    target.mkdir(parents=True)
    (target / "keep.txt").write_text("mine")
    for force in ([], ["--force"]):  # a folder ember did not write is never replaced (tests/test_force.py)
        assert "keep.txt" in _fails(capsys, ["export", str(run), "--to", "hf", str(target), *force])
    assert (target / "keep.txt").read_text() == "mine"
    (target / "keep.txt").unlink()
    assert main(["export", str(run), "--to", "hf", str(target)]) == 0
    assert "--force" in _fails(capsys, ["export", str(run), "--to", "hf", str(target)])
    assert main(["export", str(run), "--to", "hf", str(target), "--force"]) == 0
    assert (target / "config.json").is_file()
    (target / "tokenizer.json").unlink()
    back = tmp_path / "runs" / "back"
    assert "tokenizer.json" in _fails(capsys, ["import", "hf", str(target), "--out", str(back)])
    assert not back.parent.exists() or not any(back.parent.iterdir())
    assert sorted(p.name for p in target.parent.iterdir()) == ["hf"]  # no staging folder left


def test_unreadable_hf_folders_are_named(run, tmp_path, capsys):
    hf_dir, back = tmp_path / "hf", tmp_path / "back"
    export_hf(run, hf_dir)
    (hf_dir / "model.safetensors").write_bytes(b"not safetensors")
    assert "cannot load the model" in _fails(capsys, ["import", "hf", str(hf_dir), "--out", str(back)])
    (hf_dir / "config.json").write_text("{not json")
    assert "config.json cannot be read" in _fails(capsys, ["import", "hf", str(hf_dir), "--out", str(back)])
    assert not back.exists()


def test_a_layout_hf_cannot_hold_is_named(tiny_cfg, tmp_path, capsys):
    train(tiny_cfg("train.max_steps=1", "model.qk_norm=true"))
    run, out = tmp_path / "runs" / "tiny", tmp_path / "hf"
    assert "qk_norm" in _fails(capsys, ["export", str(run), "--to", "hf", str(out)])
    assert not out.exists()


def test_a_foreign_tokenizer_is_named(run, tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    export_hf(run, tmp_path / "hf")
    foreign = HFTokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))  # no ember specials
    foreign.save(str(tmp_path / "hf" / "tokenizer.json"))
    with pytest.raises(EmberError, match=r"tokenizer\.json: .*not at id 0"):
        import_hf(tmp_path / "hf", tmp_path / "imported")
    assert not (tmp_path / "imported").exists()


def test_transformers_missing_is_an_ember_error(run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    with pytest.raises(EmberError, match="pip install transformers"):
        export_hf(run, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
