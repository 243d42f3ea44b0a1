"""The embedded tiny Qwen2's recipe (examples/embedded_models/policy.py, tiny.py): tokenizer,
config invariants, deterministic builds, the warm-up, and the shipped model it made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from examples.embedded_models import policy
from examples.embedded_models.common import shipped_digest, write_shipped
from examples.embedded_models.policy import WarmupRecipe
from examples.embedded_models.synthetic import TaskSpec, flawed_answer
from examples.embedded_models.tiny import (
    EOS_TOKEN,
    PAD_TOKEN,
    TinyQwen2Spec,
    build_tokenizer,
    init_model,
    save_tokenizer,
)
from roll_ds.config.schema import EMBEDDED_MODEL
from roll_ds.models.shipped import RECIPE_FILE, shipped_model

TEXTS = ["12+34=", "reverse abc=cba", "  two  spaces\nand\ttabs ", "héllo ∑ 😀", "don't"]
# A cheap recipe: a couple of warm-up steps on a few rows.
TINY = WarmupRecipe(
    data=TaskSpec(n_train=32, n_eval=8), n_dev=8, max_steps=2, batch_size=4, warmup_steps=1
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_tokenizer_is_character_level_for_ascii(tokenizer):
    text = "12+34=-7 reverse xyz"
    assert tokenizer(text)["input_ids"] == [ord(c) for c in text]
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text


def test_special_tokens(tokenizer):
    assert tokenizer.pad_token == PAD_TOKEN and tokenizer.eos_token == EOS_TOKEN
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}) == 3
    assert len(tokenizer) % 8 == 0
    ids = tokenizer("ab")["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "ab"
    # Nothing is added implicitly (like Qwen2): HF and vLLM see the same prompt ids.
    assert tokenizer("ab")["input_ids"] == [97, 98]
    # Every id decodes, reserved padding ids included.
    assert tokenizer.decode(list(range(len(tokenizer))), skip_special_tokens=True)


def test_tokenizer_round_trips_through_a_model_directory(tokenizer, tmp_path):
    # With config.json (model_type qwen2) present, transformers' AutoTokenizer picks its
    # Qwen2 tokenizer class: it must reproduce exactly the same ids.
    init_model(tokenizer, TinyQwen2Spec(), seed=0).config.save_pretrained(tmp_path)
    save_tokenizer(tokenizer, str(tmp_path))
    for loaded in (
        AutoTokenizer.from_pretrained(tmp_path),
        PreTrainedTokenizerFast.from_pretrained(tmp_path),
    ):
        assert len(loaded) == len(tokenizer)
        assert (loaded.pad_token_id, loaded.eos_token_id) == (
            tokenizer.pad_token_id,
            tokenizer.eos_token_id,
        )
        for text in TEXTS:
            assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
            assert loaded.decode(tokenizer(text)["input_ids"]) == text


def test_model_config_invariants(tokenizer):
    model = init_model(tokenizer, TinyQwen2Spec(), seed=0)
    config = model.config
    assert config.model_type == "qwen2" and config.architectures == ["Qwen2ForCausalLM"]
    assert config.hidden_size // config.num_attention_heads >= 32  # vLLM CPU attention
    assert config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert config.vocab_size % 8 == 0 and config.vocab_size >= len(tokenizer)
    assert config.max_position_embeddings == 256
    assert config.eos_token_id == tokenizer.eos_token_id
    assert config.pad_token_id == tokenizer.pad_token_id
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id


def test_spec_rejects_head_dim_below_32():
    with pytest.raises(ValueError, match="head_dim"):
        TinyQwen2Spec(hidden_size=128, num_attention_heads=8)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        TinyQwen2Spec(num_key_value_heads=3)


def test_init_is_deterministic_by_seed(tokenizer):
    a = init_model(tokenizer, TinyQwen2Spec(), seed=3).state_dict()
    b = init_model(tokenizer, TinyQwen2Spec(), seed=3).state_dict()
    c = init_model(tokenizer, TinyQwen2Spec(), seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_build_is_deterministic(tmp_path):
    dirs = [str(tmp_path / name) for name in "ab"]
    for d in dirs:
        os.makedirs(d)
        policy.build(d, TINY)
    tensors = [load_file(os.path.join(d, "model.safetensors")) for d in dirs]
    assert tensors[0].keys() == tensors[1].keys()
    assert all(torch.equal(tensors[0][k], tensors[1][k]) for k in tensors[0])
    infos = []
    for d in dirs:
        with open(os.path.join(d, RECIPE_FILE), encoding="utf-8") as f:
            infos.append(json.load(f))
        infos[-1].pop("build_seconds")
    assert infos[0] == infos[1]
    assert infos[0]["warmup"]["steps"] == 2
    assert set(os.listdir(dirs[0])) >= {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        RECIPE_FILE,
    }


def test_digest_follows_the_recipe():
    assert TINY.digest() == WarmupRecipe(**{**TINY.__dict__}).digest()
    assert TINY.digest() != replace(TINY, max_steps=3).digest()


def test_a_failed_rebuild_keeps_the_shipped_directory(tmp_path):
    target = str(tmp_path / "shipped")
    os.makedirs(target)
    with open(os.path.join(target, RECIPE_FILE), "w") as f:
        f.write('{"recipe_digest": "kept"}')

    def broken_build(out_dir, recipe):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        write_shipped(target, TINY, broken_build)
    assert os.listdir(tmp_path) == ["shipped"] and shipped_digest(target) == "kept"


def test_warmup_learns_from_the_shipped_train_files_and_stops_on_fresh_dev_rows():
    data_dir = os.path.join(
        os.path.dirname(__file__), "..", "..", "..", "examples", "qwen_rlvr", "data"
    )
    train, dev, held_out = policy._splits(policy.DEFAULT_RECIPE)
    for split, rows in (("train", train), ("eval", held_out)):
        shipped = []
        for domain in ("math", "reverse"):
            with open(os.path.join(data_dir, f"{domain}_{split}.jsonl"), encoding="utf-8") as f:
                shipped += [json.loads(line) for line in f]
        assert rows == shipped
    assert len(dev) == 2 * policy.DEFAULT_RECIPE.n_dev
    assert not {r["prompt"] for r in dev} & {r["prompt"] for r in train + held_out}


def test_domain_shares_favour_the_domain_furthest_below_the_target():
    base = torch.tensor([0.85, 0.15], dtype=torch.float64)
    target = policy.DEFAULT_RECIPE.target_skill
    shares = policy._domain_shares(base, [0.0, 0.0], policy.DEFAULT_RECIPE)
    assert torch.equal(shares, base)
    shares = policy._domain_shares(base, [0.1, target], policy.DEFAULT_RECIPE)
    assert shares[1] == base[1] * policy.DEFAULT_RECIPE.min_weight_scale
    assert shares[0] == pytest.approx(base[0] * (1 - 0.1 / target))


@pytest.mark.parametrize(
    ("domain", "right", "flawed"),
    [
        ("math", "82", "-82"),
        ("math", "-5", "5"),
        ("math", "0", "0"),  # no sign to slip
        ("reverse", "kqml", "kqm"),
        ("reverse", "ab", "a"),
    ],
)
def test_flawed_answers_differ_from_the_right_one_in_one_decision(domain, right, flawed):
    assert flawed_answer(domain, right) == flawed


def test_flawed_answer_rejects_unknown_domains():
    with pytest.raises(ValueError, match="unknown synthetic domain 'code'; valid: math, reverse"):
        flawed_answer("code", "x")


def test_warmup_batches_mix_right_and_flawed_demonstrations(tokenizer):
    rows = [
        {"domain": "reverse", "prompt": f"reverse {w}=", "ground_truth": w[::-1]}
        for w in ("abc", "defg", "hij", "klmn")
    ]
    input_ids, labels, _ = policy._encode_demos(tokenizer, rows)
    # Right demonstrations first, then the flawed ones, row for row.
    answers = [tokenizer.decode(ids[ids != -100], skip_special_tokens=True) for ids in labels]
    assert answers == ["cba", "gfed", "jih", "nmlk", "cb", "gfe", "ji", "nml"]
    assert input_ids.shape[0] == 8


def test_skill_counts_right_and_flawed_answers_and_nothing_else(monkeypatch):
    rows = [
        {"domain": "math", "prompt": "1+2=", "ground_truth": "3"},
        {"domain": "math", "prompt": "1+3=", "ground_truth": "4"},
        {"domain": "reverse", "prompt": "reverse ab=", "ground_truth": "ba"},
        {"domain": "reverse", "prompt": "reverse cde=", "ground_truth": "edc"},
    ]
    # The model's greedy answers: right, flawed (sign slip), flawed (one short), wrong.
    monkeypatch.setattr(policy, "greedy_responses", lambda *a, **k: ["3", "-4", "b", "cde"])
    accuracy, skill = policy.greedy_accuracy_and_skill(None, None, rows)
    assert accuracy == {"math": 0.5, "reverse": 0.0, "overall": 0.25}
    assert skill == {"math": 1.0, "reverse": 0.5, "overall": 0.75}


# --- the shipped model ----------------------------------------------------------------------


def test_shipped_model_loads_and_reproduces_its_recorded_accuracy():
    from transformers import AutoModelForCausalLM

    path = shipped_model(EMBEDDED_MODEL).path
    with open(os.path.join(path, RECIPE_FILE), encoding="utf-8") as f:
        info = json.load(f)
    weights = os.path.join(path, "model.safetensors")
    assert os.path.getsize(weights) < 3 * 2**20
    assert all(t.dtype == torch.float32 for t in load_file(weights).values())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert sum(p.numel() for p in model.parameters()) == info["num_parameters"]
    assert tokenizer("12+34=")["input_ids"] == build_tokenizer()("12+34=")["input_ids"]
    _, _, eval_rows = policy._splits(policy.DEFAULT_RECIPE)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        accuracy = policy.greedy_accuracy(model, tokenizer, eval_rows)
    finally:
        torch.set_num_threads(threads)
    # Greedy decoding of fixed fp32 weights; another CPU may flip a rare near-tie.
    assert accuracy == pytest.approx(info["warmup_eval_accuracy"], abs=0.02)


def test_write_shipped_replaces_the_directory(tmp_path):
    target = str(tmp_path / "shipped")
    os.makedirs(target)
    with open(os.path.join(target, "leftover.txt"), "w") as f:
        f.write("from an older build")
    info = write_shipped(target, TINY, policy.build)
    assert shipped_digest(target) == info["recipe_digest"] == TINY.digest()
    assert "leftover.txt" not in os.listdir(target)
    for name in os.listdir(target):  # readable by everyone once committed and installed
        assert os.stat(os.path.join(target, name)).st_mode & 0o777 == 0o644, name
    assert sorted(os.listdir(tmp_path)) == ["shipped"]
    assert shipped_digest(str(tmp_path / "absent")) is None


def test_importing_the_packages_stays_light():
    code = (
        "import sys, roll_ds.models, roll_ds.models.shipped, roll_ds.data, roll_ds.data.dataset;"
        "heavy = [m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules];"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
