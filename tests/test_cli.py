"""The `hybridd generate` contract that other tools script against."""

from __future__ import annotations

import json
import subprocess
import sys

from hybrid import LLM, SamplingParams


def hybridd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybrid.cli.main", *args], capture_output=True, text=True, timeout=300)


def test_generate_json_prints_exactly_one_object(model_dirs):
    model = model_dirs["tiny-deepseek-v3"]
    r = hybridd("generate", "--model", str(model), "--prompt-ids", "5,6,7,8,9", "--max-tokens", "12",
                "--temperature", "0", "--json", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert {"token_ids", "text", "prompt_tokens", "ttft_s", "tpot_s"} <= set(out)
    assert out["prompt_tokens"] == 5 and len(out["token_ids"]) == 12
    assert out["ttft_s"] > 0 and out["tpot_s"] > 0
    expected = LLM(model).generate([5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert out["token_ids"] == expected[0].token_ids


def test_generate_text_and_chat_on_the_embedded_default():
    r = hybridd("generate", "--prompt", "def main():", "--max-tokens", "6", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prompt_tokens"] > 0 and 1 <= len(out["token_ids"]) <= 6
    r = hybridd("generate", "--chat", "--prompt", "hello", "--max-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["prompt_tokens"] > 5
    r = hybridd("generate", "--prompt", "hello", "--max-tokens", "4")
    assert r.returncode == 0 and "generated" in r.stderr


def test_errors_are_one_clear_line(tmp_path):
    r = hybridd("generate", "--model", str(tmp_path), "--prompt", "x")
    assert r.returncode == 2
    assert r.stderr.strip() == f"hybridd: error: {tmp_path}: no config.json (is this a Hugging Face model directory?)"
    r = hybridd("generate", "--prompt-ids", "1,x")
    assert r.returncode == 2 and "comma-separated integers" in r.stderr
    r = hybridd("generate", "--prompt-ids", "1,99999999")
    assert r.returncode == 2 and "outside the vocabulary" in r.stderr
