"""The `hybridd generate` contract that other tools script against."""

from __future__ import annotations

import json
import os
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
    for flags, needle in ((["--kv-cache-gb", "inf"], "--kv-cache-gb: wants a positive number of GiB"),
                          (["--kv-cache-gb", "0"], "--kv-cache-gb: wants a positive number of GiB"),
                          (["--max-model-len", "999999"], "max_model_len=999999 is beyond the 4096 positions"),
                          (["--expert-pack", str(tmp_path / "typo")], "no complete expert pack"),
                          (["--gpus", "0", "--attn-device", "cpu", "--experts", "inline"], "leave --experts inline"),
                          (["--gpus", "0", "--attn-device", "cpu", "--backend", "cpu"], "leave --backend cpu")):
        code, err = in_process("generate", "--prompt", "x", *flags)
        assert code == 2 and needle in err.strip().splitlines()[-1], (flags, err)
    for flags, needle in ((["--max-tokens", "0"], "max_tokens must be >= 1"),
                          (["--top-p", "0"], "top_p must be in (0, 1]"),
                          (["--chat"], "--chat needs --prompt text")):
        # the request's own flags are refused before the model loads: a wrong --model is not even read
        code, err = in_process("generate", "--model", str(tmp_path), "--prompt-ids", "5", *flags)
        assert code == 2 and needle in err, (flags, err)


def in_process(*argv: str) -> tuple[int, str]:
    """hybridd's exit code and stderr for a command line that fails before it serves anything, run in this
    process (a fresh interpreter per refusal took two seconds each)."""
    import contextlib
    import io

    from hybrid.cli.main import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse's own refusals
            code = e.code
    return code, err.getvalue()


def test_start_refuses_what_its_engines_would_refuse_before_starting_anything(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDD_HOME", str(tmp_path / "home"))
    for flags, needle in ((["--disagg", "--tp", "2"], "disaggregation is not combined"),
                          (["--expert-pack", str(tmp_path / "typo")], "no complete expert pack"),
                          (["--tp", "2", "--expert-pack", str(tmp_path)], "leave --expert-pack out"),
                          (["--disagg", "--prefill-cores", str(len(os.sched_getaffinity(0)))],
                           "leaves the decode engine no core")):
        if "--prefill-cores" in flags and len(os.sched_getaffinity(0)) < 2:
            continue  # on one core both engines share it
        code, err = in_process("start", "--port", "1", *flags)
        assert code == 2 and needle in err, (flags, err)
    assert not (tmp_path / "home" / "hybridd.pid").exists() and not (tmp_path / "typo").exists()
    long_home = tmp_path / ("h" * 100)
    monkeypatch.setenv("HYBRIDD_HOME", str(long_home))
    code, err = in_process("start", "--port", "1")
    assert code == 2 and "is too long" in err and not long_home.exists(), err


def test_doctor_says_whether_the_disk_has_room_for_the_first_pack(model_dirs, tmp_path, monkeypatch, capsys):
    from collections import namedtuple

    from hybrid.cli import doctor
    from hybrid.cli.main import main

    monkeypatch.setenv("HYBRIDD_HOME", str(tmp_path / "home"))
    model = str(model_dirs["tiny-qwen3-moe"])

    def packs_finding() -> tuple[int, dict]:
        code = main(["doctor", "--model", model, "--json", "--no-plan"])
        return code, next(f for f in json.loads(capsys.readouterr().out)["findings"] if f["topic"] == "packs")

    code, finding = packs_finding()
    assert code == 0 and finding["ok"] and "the first start packs this model's experts" in finding["detail"]
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(doctor.shutil, "disk_usage", lambda _: usage(10**6, 10**6, 0))
    code, finding = packs_finding()
    assert code == 1 and not finding["ok"] and "0.0 GB free" in finding["detail"]
