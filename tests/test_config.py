"""ember.config: defaults, presets, base chains, overrides, errors that point at
the source, and the YAML round trip."""

from __future__ import annotations

import dataclasses
import tempfile
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.config import (
    PRESETS_DIR,
    Config,
    DataConfig,
    available_presets,
    config_keys,
    config_to_dict,
    config_to_yaml,
    load_config,
)
from ember.errors import ConfigError


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


# --- defaults and presets ----------------------------------------------------


def test_defaults() -> None:
    cfg = load_config()
    assert cfg == Config()
    assert (cfg.run.name, cfg.run.out_dir, cfg.run.seed) == ("ember", "runs", 1337)
    d = cfg.data
    assert d.sources == ["embedded:python"]
    assert d.dir == "data/python"
    assert (d.tokenizer, d.vocab_size, d.val_fraction, d.test_sources) == ("bpe", 4096, 0.05, [])
    assert d.tokenizer_train_bytes == 20_000_000
    assert (d.jsonl_field, d.parquet_column) == ("text", "text")
    assert (d.min_chars, d.max_nontext_fraction, d.dedup) == (1, 0.3, True)
    assert (d.shard_tokens, d.sampling) == (100_000_000, "random")


def test_default_lists_are_not_shared() -> None:
    a, b = DataConfig(), DataConfig()
    a.sources.append("x")
    assert b.sources == ["embedded:python"]


def test_python_preset_equals_defaults_except_name_and_test_sources() -> None:
    cfg = load_config("python")
    assert cfg.run.name == "python"
    assert cfg.data.test_sources == ["embedded:python-tests"]  # a user corpus has no such held-out origin
    assert cfg == dataclasses.replace(
        Config(),
        run=dataclasses.replace(Config().run, name="python"),
        data=dataclasses.replace(Config().data, test_sources=["embedded:python-tests"]),
    )


def test_tiny_preset_inherits_from_python() -> None:
    cfg = load_config("tiny")
    assert cfg.run.name == "tiny"
    assert cfg.data.dir == "data/tiny"
    assert cfg.data.sources == ["embedded:python-docs"]
    assert cfg.data.vocab_size == 512
    assert cfg.data.tokenizer_train_bytes == 2_000_000
    assert cfg.data.shard_tokens == 100_000_000  # kept from python.yaml


def test_preset_by_path_equals_preset_by_name() -> None:
    assert load_config(PRESETS_DIR / "tiny.yaml") == load_config("tiny")
    assert {"python", "tiny"} <= set(available_presets())


def test_local_configs_dir_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "configs").mkdir()
    write(tmp_path / "configs" / "tiny.yaml", "run:\n  name: local\n")
    monkeypatch.chdir(tmp_path)
    assert load_config("tiny").run.name == "local"
    assert load_config("python").run.name == "python"  # falls back to the repo's presets


def test_missing_file_lists_presets(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"not found.*available presets: .*tiny"):
        load_config("no_such_preset")
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


# --- base chains ---------------------------------------------------------------


def test_base_chain_merges_in_order(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", "run:\n  name: a\n  seed: 1\ndata:\n  vocab_size: 100\n  dedup: false\n")
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "b.yaml", "base: ../a.yaml\nrun:\n  name: b\ndata:\n  vocab_size: 200\n")
    c = write(tmp_path / "c.yaml", "base: sub/b.yaml\ndata:\n  sources: [x, y]\n")
    cfg = load_config(c)
    assert cfg.run.name == "b"  # child overrides parent
    assert cfg.run.seed == 1  # grandparent kept
    assert cfg.data.vocab_size == 200
    assert cfg.data.dedup is False
    assert cfg.data.sources == ["x", "y"]


def test_base_may_name_a_preset(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path / "mine.yaml", "base: tiny\ndata:\n  vocab_size: 64\n"))
    assert (cfg.run.name, cfg.data.dir, cfg.data.vocab_size) == ("tiny", "data/tiny", 64)


def test_base_cycle(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", "base: b.yaml\n")
    write(tmp_path / "b.yaml", "base: c.yaml\n")
    write(tmp_path / "c.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match=r"base cycle: .*a\.yaml -> .*b\.yaml -> .*c\.yaml -> .*a\.yaml"):
        load_config(tmp_path / "a.yaml")


def test_self_base_is_a_cycle(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="base cycle"):
        load_config(write(tmp_path / "a.yaml", "base: a.yaml\n"))


def test_missing_base(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'gone.yaml' not found \(base of .*a\.yaml line 2\)"):
        load_config(write(tmp_path / "a.yaml", "# top\nbase: gone.yaml\n"))


# --- overrides -----------------------------------------------------------------


def test_overrides_scalars_lists_and_order(tmp_path: Path) -> None:
    cfg = load_config(
        "tiny",
        [
            "run.seed=3",
            "data.sources=[a, 'b c']",
            "data.val_fraction=1e-3",
            "data.dedup=false",
            "data.vocab_size=100",
            "data.vocab_size=300",  # later wins
            "data={min_chars: 5}",  # a nested mapping merges into the section
        ],
    )
    assert cfg.run.seed == 3
    assert cfg.data.sources == ["a", "b c"]
    assert cfg.data.val_fraction == pytest.approx(1e-3)
    assert cfg.data.dedup is False
    assert cfg.data.vocab_size == 300
    assert cfg.data.min_chars == 5
    assert cfg.data.dir == "data/tiny"  # untouched keys stay


def test_numbers_keep_their_text_in_str_fields(tmp_path: Path) -> None:
    cfg = load_config(None, ["run.name=007", "data.sources=[1e3, 0x1F, 2]", "data.shard_tokens=1_000"])
    assert cfg.run.name == "007"
    assert cfg.data.sources == ["1e3", "0x1F", "2"]
    assert cfg.data.shard_tokens == 1000
    cfg = load_config(write(tmp_path / "x.yaml", "run:\n  name: 007\ndata:\n  sources:\n    - 1.50\n"))
    assert (cfg.run.name, cfg.data.sources) == ("007", ["1.50"])


def test_override_without_equals() -> None:
    with pytest.raises(ConfigError, match=r"`data.vocab_size` is not key=value"):
        load_config(None, ["data.vocab_size"])


def test_unknown_override_suggests() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["data.vocab_sise=3"])
    msg = str(e.value)
    assert "data.vocab_sise" in msg
    assert "command-line override `data.vocab_sise=3`" in msg
    assert "did you mean data.vocab_size?" in msg


def test_key_in_wrong_section_suggests_the_right_one() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key vocab_size .*did you mean data.vocab_size\?"):
        load_config(None, ["vocab_size=3"])


def test_sections_reject_unknown_keys(tmp_path: Path) -> None:
    for section in ("train", "parallel"):
        with pytest.raises(ConfigError, match=rf"unknown config key {section}\.n_layer"):
            load_config(None, [f"{section}.n_layer=2"])
    with pytest.raises(ConfigError, match=r"model\.n_layers .*did you mean model\.n_layer"):
        load_config(None, ["model.n_layers=2"])
    cfg = load_config(write(tmp_path / "e.yaml", "model: {}\ntrain:\nparallel: {}\n"))
    assert cfg == Config()


# --- errors in files -------------------------------------------------------------


def test_unknown_key_in_file_names_key_file_line_and_suggestion(tmp_path: Path) -> None:
    path = write(
        tmp_path / "x.yaml",
        """
        run:
          name: x
        data:
          dir: d
          vocab_sise: 512
        """,
    )
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert "data.vocab_sise" in msg
    assert "x.yaml line 5" in msg
    assert "did you mean data.vocab_size?" in msg


def test_unknown_key_in_base_points_at_base(tmp_path: Path) -> None:
    write(tmp_path / "parent.yaml", "run:\n  seeed: 1\n")
    child = write(tmp_path / "child.yaml", "base: parent.yaml\n")
    with pytest.raises(ConfigError, match=r"run\.seeed \(.*parent\.yaml line 2\); did you mean run\.seed\?"):
        load_config(child)


def test_wrong_type_message(tmp_path: Path) -> None:
    path = write(tmp_path / "x.yaml", "run:\n  seed: 1\ndata:\n  tokenizer: bpe\n  vocab_size: abc\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "data.vocab_size expects int, got 'abc' (" in str(e.value)
    assert "x.yaml line 5)" in str(e.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("data:\n  vocab_size: 3.5\n", r"data\.vocab_size expects int, got 3\.5"),
        ("data:\n  dedup: maybe\n", r"data\.dedup expects bool, got 'maybe'"),
        ("data:\n  sources: abc\n", r"data\.sources expects list\[str\], got 'abc'"),
        (
            "data:\n  sources:\n    - a\n    - [b]\n",
            r"data\.sources\[1\] expects str, got \['b'\] \(.* line 4\)",
        ),
        ("run:\n  name: yes\n", r"run\.name expects str, got True .*quote it"),
        ("data: 3\n", r"data is a section and expects a mapping"),
        ("run:\n  seed:\n", r"run\.seed expects int, got null"),
    ],
)
def test_wrong_types(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_config(write(tmp_path / "x.yaml", text))


def test_numeric_strings_convert(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path / "x.yaml", "data:\n  vocab_size: '64'\n  val_fraction: 1e-2\n"))
    assert cfg.data.vocab_size == 64
    assert cfg.data.val_fraction == pytest.approx(0.01)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("data.tokenizer=wordpiece", r"data\.tokenizer must be one of 'bpe', 'char'; got 'wordpiece'"),
        ("data.sampling=shuffle", r"data\.sampling must be one of 'random', 'epoch'; got 'shuffle'"),
        ("data.val_fraction=1.0", r"data\.val_fraction must be in \[0, 1\)"),
        ("data.val_fraction=-0.1", r"data\.val_fraction must be in \[0, 1\)"),
        ("data.vocab_size=0", r"data\.vocab_size must be >= 1"),
        ("data.min_chars=-1", r"data\.min_chars must be >= 0"),
        ("data.max_nontext_fraction=1.5", r"data\.max_nontext_fraction must be in \[0, 1\]"),
        ("data.shard_tokens=0", r"data\.shard_tokens must be > 0"),
        ("data.tokenizer_train_bytes=0", r"data\.tokenizer_train_bytes must be > 0"),
        ("data.sources=[]", r"data\.sources is empty"),
        (
            "data={val_fraction: 0.6, test_fraction: 0.5}",
            r"data\.val_fraction \+ data\.test_fraction must be < 1; got 0\.6 \+ 0\.5",
        ),
        ("train.decay_fraction=0", r"train\.decay_fraction must be in \(0, 1\]; got 0\.0"),
        ("train.qlora=true", r"train\.qlora=true adapts .*; give it train\.lora_rank"),
        ("model.n_layer=100000", r"model\.n_layer must be in \[1, 1024\]; got 100000"),
    ],
)
def test_bad_values(override: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_config(None, [override])


def test_every_declared_choice_and_bound_is_enforced() -> None:
    checked = 0
    for section in ("run", "data", "model", "train", "parallel"):
        for f in dataclasses.fields(getattr(Config(), section)):
            key = f"{section}.{f.name}"
            choices = f.metadata["choices"]  # strings, or numbers (train.qat_group_size)
            bad = [("nope" if isinstance(choices[0], str) else max(choices) + 1)] if choices else []
            for op, bound in f.metadata["bounds"]:  # a value just outside each bound
                cast, step = (int, 1) if type(f.default) is int else (float, 0.5)
                bad.append(cast({">=": bound - step, ">": bound, "<=": bound + step, "<": bound}[op]))
            for value in bad:
                with pytest.raises(ConfigError, match=rf"^{key} must be .*; got {value!r} \(command-line"):
                    load_config(None, [f"{key}={value}"])
                checked += 1
    assert checked > 50


def test_bad_enum_in_file_names_line(tmp_path: Path) -> None:
    path = write(tmp_path / "x.yaml", "data:\n  dir: d\n  tokenizer: wordpiece\n")
    with pytest.raises(ConfigError, match=r"data\.tokenizer must be one of .* \(.*x\.yaml line 3\)"):
        load_config(path)


def test_boundary_values_are_valid() -> None:
    cfg = load_config(None, ["data.val_fraction=0", "data.max_nontext_fraction=1", "data.min_chars=0"])
    assert (cfg.data.val_fraction, cfg.data.max_nontext_fraction, cfg.data.min_chars) == (0.0, 1.0, 0)
    assert load_config(None, ["data.tokenizer=char", "data.sampling=epoch"]).data.sampling == "epoch"


def test_direct_construction_is_validated() -> None:
    with pytest.raises(ConfigError, match="data.tokenizer"):
        DataConfig(tokenizer="wordpiece")


def test_yaml_syntax_error(tmp_path: Path) -> None:
    path = write(tmp_path / "bad.yaml", "run:\n  name: x\ndata:\n  sources: [a, b\n  dir: d\n")
    with pytest.raises(ConfigError, match=r"YAML syntax error in .*bad\.yaml line \d+"):
        load_config(path)


def test_duplicate_key(tmp_path: Path) -> None:
    path = write(tmp_path / "dup.yaml", "data:\n  vocab_size: 1\n  vocab_size: 2\n")
    with pytest.raises(
        ConfigError, match=r"duplicate key data\.vocab_size \(.*dup\.yaml line 3; first set on line 2\)"
    ):
        load_config(path)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_top_level_must_be_mapping(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path / "x.yaml", text))


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path / "empty.yaml", "# nothing\n")) == Config()


def test_interpolation(tmp_path: Path) -> None:
    path = write(tmp_path / "x.yaml", "run:\n  name: r\ndata:\n  dir: data/${run.name}\n")
    assert load_config(path).data.dir == "data/r"
    with pytest.raises(ConfigError, match=r"data\.dir: .*nope"):
        load_config(path, ["data.dir=${nope}"])


# --- dump and keys -----------------------------------------------------------------


def test_round_trip(tmp_path: Path) -> None:
    cfg = load_config(
        "tiny", ["data.sources=[a, 'yes', '1', 'x: y']", "data.val_fraction=1e-5", "run.name=007"]
    )
    text = config_to_yaml(cfg)
    assert text.index("run:") < text.index("data:") < text.index("model:")
    path = tmp_path / "config.yaml"
    path.write_text(text, encoding="utf-8")
    assert load_config(path) == cfg
    assert config_to_dict(load_config(path)) == config_to_dict(cfg)


# Printable text: PyYAML's emitter does not round-trip control characters such
# as NEL (\x85), which YAML treats as a line break.
TEXT = st.characters(codec="utf-8", exclude_categories=("Cs", "Cc", "Zl", "Zp"))


@settings(max_examples=25, deadline=None)
@given(
    name=st.text(TEXT, min_size=1, max_size=12),
    seed=st.integers(0, 2**31 - 1),
    sources=st.lists(st.text(TEXT, max_size=8), min_size=1, max_size=3),
    val_fraction=st.floats(0.0, 0.979, allow_nan=False),  # + test_fraction 0.02 < 1
    dedup=st.booleans(),
)
def test_round_trip_property(
    name: str, seed: int, sources: list[str], val_fraction: float, dedup: bool
) -> None:
    # Strings that look like interpolations are resolved on load, by design.
    if any("${" in s for s in (name, *sources)):
        return
    cfg = Config()
    cfg.run.name, cfg.run.seed = name, seed
    cfg.data.sources, cfg.data.val_fraction, cfg.data.dedup = sources, val_fraction, dedup
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.yaml"
        path.write_text(config_to_yaml(cfg), encoding="utf-8")
        assert load_config(path) == cfg


def test_config_keys_cover_every_leaf() -> None:
    keys = config_keys()
    names = [k for k, _, _, _ in keys]
    expected = [
        f"{section}.{f.name}"
        for section in ("run", "data", "model", "train", "sft", "dpo", "grpo", "parallel", "serve")
        for f in dataclasses.fields(getattr(Config(), section))
    ]
    assert names == expected
    leaves = {f"{s}.{k}" for s, sub in config_to_dict(Config()).items() for k in sub}
    assert set(names) == leaves
    table = {k: (t, d, h) for k, t, d, h in keys}
    assert table["data.vocab_size"][:2] == ("int >= 1", "4096")
    assert table["data.val_fraction"][0] == "float in [0, 1)"
    assert table["train.decay_fraction"][0] == "float in (0, 1]"
    assert table["data.tokenizer"][0] == "'bpe' | 'char'"
    assert table["data.sources"][:2] == ("list[str]", "['embedded:python']")
    assert table["data.dedup"][0] == "bool"
    assert all(h for _, _, _, h in keys), "every key needs a help text"
    for key in names:  # every listed key is settable by name
        section, name = key.split(".")
        value = getattr(getattr(Config(), section), name)
        assert (
            load_config(None, [f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}"])
            == Config()
        )


def test_config_keys_prints_types_literally(capsys) -> None:
    from ember.cli import main

    assert main(["config", "keys", "data.sources"]) == 0
    assert "list[str]" in capsys.readouterr().out  # not read as rich markup
