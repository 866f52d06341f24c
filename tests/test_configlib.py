from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import pytest
import yaml

from logitless.configlib import ConfigError, load_config, to_dict, to_yaml, valid_keys


@dataclass
class Lora:
    r: int = 8
    alpha: float = 16.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj"])


@dataclass
class Model:
    name: str = "tiny"
    dtype: Literal["float32", "bfloat16"] = "float32"
    lora: Optional[Lora] = None
    revision: str | None = None


@dataclass
class Optim:
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float | None = 1.0
    fused: bool = False


@dataclass
class Cfg:
    model: Model = field(default_factory=Model)
    optim: Optim = field(default_factory=Optim)
    seed: int = 0
    extra: dict[str, int] = field(default_factory=dict)
    notes: Any = None


@dataclass
class Sec:
    n: int

    def __post_init__(self):
        if self.n < 0:
            raise ValueError(f"n must be >= 0, got {self.n}")


@dataclass
class Top:
    sec: Sec = field(default_factory=lambda: Sec(1))


@dataclass
class Req:
    need: int


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


def test_defaults_without_file_or_overrides():
    assert load_config(Cfg, None, []) == Cfg()


def test_yaml_then_overrides_in_order(tmp_path):
    path = write(tmp_path, "optim:\n  lr: 3.0e-4\n  fused: true\nseed: 7\nmodel:\n  name: from-yaml\n")
    cfg = load_config(Cfg, path, ["optim.lr=1e-4", "model.lora.r=16", "model.lora.target_modules=[q_proj,v_proj]"])
    assert cfg.optim.lr == 1e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.fused is True and cfg.seed == 7 and cfg.model.name == "from-yaml"
    assert cfg.model.lora == Lora(r=16, alpha=16.0, target_modules=["q_proj", "v_proj"])
    assert cfg.optim.betas == (0.9, 0.999)  # untouched defaults stay


def test_override_values_parsed_as_yaml():
    cfg = load_config(
        Cfg,
        None,
        ["optim.grad_clip=null", "optim.lr=2", "optim.betas=[0.5, 0.6]", "model.dtype=bfloat16", "extra.k=3",
         "model.name=007", "model.revision=null", "notes={a: 1}"],
    )
    assert cfg.optim.grad_clip is None
    assert cfg.optim.lr == 2.0 and isinstance(cfg.optim.lr, float)  # int accepted for float
    assert cfg.optim.betas == (0.5, 0.6)
    assert cfg.model.dtype == "bfloat16"
    assert cfg.extra == {"k": 3}
    assert cfg.model.name == "007"  # a str field keeps the text as written
    assert cfg.model.revision is None
    assert cfg.notes == {"a": 1}


def test_yaml_float_without_dot_accepted(tmp_path):
    # PyYAML reads `1e-4` as a string; a float field still accepts it.
    cfg = load_config(Cfg, write(tmp_path, "optim:\n  lr: 1e-4\n"), [])
    assert cfg.optim.lr == 1e-4


@pytest.mark.parametrize(
    "override,suggestion",
    [("optim.lr_rate=1", "optim.lr"), ("optm.lr=1", "optim.lr"), ("model.lora.rank=4", "model.lora.r"),
     ("sed=1", "seed")],
)
def test_unknown_override_key_suggests_nearest(override, suggestion):
    with pytest.raises(ConfigError) as e:
        load_config(Cfg, None, [override])
    key = override.split("=")[0]
    assert f"unknown config key '{key}'" in str(e.value)
    assert f"did you mean '{suggestion}'?" in str(e.value)


def test_unknown_yaml_key_suggests_nearest(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'optim\.lr_rate'.*did you mean 'optim\.lr'\?"):
        load_config(Cfg, write(tmp_path, "optim:\n  lr_rate: 0.1\n"), [])
    with pytest.raises(ConfigError, match=r"unknown config key 'modle'.*did you mean 'model'\?"):
        load_config(Cfg, write(tmp_path, "modle:\n  name: x\n"), [])
    with pytest.raises(ConfigError, match=r"unknown config key 'model\.lora\.alfa'.*'model\.lora\.alpha'"):
        load_config(Cfg, write(tmp_path, "model:\n  lora:\n    alfa: 1\n"), [])


@pytest.mark.parametrize(
    "override,expected",
    [
        ("seed=1.5", r"'seed' expects int, got float 1.5"),
        ("seed=true", r"'seed' expects int, got bool True"),
        ("optim.lr=fast", r"'optim.lr' expects float, got str 'fast'"),
        ("optim.fused=1", r"'optim.fused' expects bool, got int 1"),
        ("model.dtype=fp16", r"'model.dtype' expects one of 'float32', 'bfloat16', got str 'fp16'"),
        ("optim.betas=[0.9]", r"'optim.betas' expects tuple\[float, float\] \(2 items\)"),
        ("model.lora.target_modules=q_proj", r"'model.lora.target_modules' expects list\[str\], got str"),
        ("model.lora.target_modules=[1]", r"'model.lora.target_modules\[0\]' expects str, got int 1"),
        ("extra.k=x", r"'extra.k' expects int, got str 'x'"),
        ("optim=3", r"'optim' expects section Optim, got int 3"),
    ],
)
def test_wrong_types_refused(override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(Cfg, None, [override])


def test_wrong_type_in_yaml_and_nested_optional_section(tmp_path):
    with pytest.raises(ConfigError, match=r"'model.lora.r' expects int, got str 'big'"):
        load_config(Cfg, write(tmp_path, "model:\n  lora:\n    r: big\n"), [])


def test_malformed_overrides_and_files(tmp_path):
    with pytest.raises(ConfigError, match="'optim.lr' has no '=': write it as optim.lr=VALUE, one word"):
        load_config(Cfg, None, ["optim.lr"])
    with pytest.raises(ConfigError, match="empty key"):
        load_config(Cfg, None, ["optim.=1"])
    with pytest.raises(ConfigError, match="'seed' is a value of type int, not a section"):
        load_config(Cfg, None, ["seed.x=1"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Cfg, str(tmp_path / "nope.yaml"), [])
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(Cfg, write(tmp_path, "- 1\n- 2\n"), [])
    assert isinstance(ConfigError("x"), ValueError)


def test_missing_required_and_post_init_validation():
    with pytest.raises(ConfigError, match="missing required config key 'need'"):
        load_config(Req, None, [])
    with pytest.raises(ConfigError, match="invalid config section 'sec': n must be >= 0, got -1"):
        load_config(Top, None, ["sec.n=-1"])


def test_to_dict_and_yaml_round_trip(tmp_path):
    cfg = load_config(Cfg, None, ["model.lora.r=4", "optim.lr=3e-4", "extra.a=1", "model.name=007"])
    d = to_dict(cfg)
    assert d["optim"]["betas"] == [0.9, 0.999] and d["model"]["lora"]["r"] == 4
    text = to_yaml(cfg)
    assert yaml.safe_load(text) == d
    assert load_config(Cfg, write(tmp_path, text), []) == cfg


def test_valid_keys_lists_sections_and_leaves():
    keys = valid_keys(Cfg)
    assert "model.lora.r" in keys and "model.lora" in keys and "optim.lr" in keys and "seed" in keys


@pytest.mark.parametrize(
    "text, key, line, first",
    [
        ("optim:\n  lr: 0.1\nseed: 1\noptim:\n  fused: true\n", "optim", 4, 1),  # a section twice: YAML drops the first
        ("optim:\n  lr: 0.1\n  fused: true\n  lr: 0.2\n", "optim.lr", 4, 2),  # a key twice in a section
        ("extra: {a: 1, b: 2, a: 3}\n", "extra.a", 1, 1),
        ("seed: 1\n'seed': 2\n", "seed", 2, 1),  # quoted or not, the same key
    ],
)
def test_a_key_given_twice_is_refused_naming_it_and_its_lines(tmp_path, text, key, line, first):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=rf"config file '{p}': line {line} gives '{key}' again \(first at line "
                                          rf"{first}\); YAML would silently keep only the last one\. Merge them"):
        load_config(Cfg, p)
    with pytest.raises(ConfigError, match=r"config override 'extra': line 1 gives 'extra.a' again"):
        load_config(Cfg, None, ["extra={a: 1, a: 2}"])


def test_merge_keys_and_equal_values_under_other_keys_are_not_duplicates(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("base: &b {r: 4}\nmodel:\n  lora:\n    <<: *b\n    r: 8\noptim: {lr: 0.1}\nseed: 1\n"
                 .replace("base: &b {r: 4}\n", "extra: &b {r: 4}\n"))
    cfg = load_config(Cfg, p)
    assert cfg.model.lora.r == 8 and cfg.extra == {"r": 4} and cfg.seed == 1
