"""Tests for seq2seq/serve/access.py and its command (keys.py): keys stored hashed, found in constant time, limits
per key and per client address in fixed windows, shared by processes through the file; then a real server with
--api-keys under a bounded loopback load: no request over a key's limit is served, and other keys are unaffected."""

import hashlib
import sqlite3
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from serving import SENTENCES, Running

from seq2seq.inference.translator import Translator
from seq2seq.serve.access import AccessError, Gate, KeyStore, Limits, Refused, connect
from seq2seq.serve.app import create_app
from seq2seq.serve.keys import main as keys_main
from seq2seq.serve.server import main as server_main

REPO = Path(__file__).resolve().parents[2]


class Clock:
    """A wall clock the test moves: windows are minutes and days of it."""

    def __init__(self, now: float = 1_800_057_600.0) -> None:  # 2027-01-16 00:00 UTC: a day's start
        self.now = now

    def __call__(self) -> float:
        return self.now


def new_key(db: Path, *flags: str, capsys: pytest.CaptureFixture) -> str:
    keys_main(["--db", str(db), "add", *flags])
    return capsys.readouterr().out.strip()


def test_keys_are_stored_hashed_and_listed_without_them(tmp_path: Path, capsys: pytest.CaptureFixture):
    db = tmp_path / "keys.db"
    key = new_key(db, "--req-limit", "60", "--char-limit", "100000", "--note", "team A", capsys=capsys)
    assert key.startswith("s2s_") and len(key) > 40
    raw = db.read_bytes() + b"".join(p.read_bytes() for p in tmp_path.glob("keys.db-*"))
    secret = key.removeprefix("s2s_").partition("_")[2]  # (a secret may hold "_" itself)
    assert key.encode() not in raw and secret.encode() not in raw  # neither the key nor its secret
    rows = sqlite3.connect(db).execute("SELECT id, digest, req_limit, char_limit, note FROM keys").fetchall()
    assert rows == [(key.split("_")[1], hashlib.sha256(key.encode()).digest(), 60, 100000, "team A")]
    keys_main(["--db", str(db), "list"])
    listed = capsys.readouterr().out
    assert key.split("_")[1] in listed and "team A" in listed and "100000" in listed and key not in listed
    store = KeyStore(connect(db))
    assert store.find(key).id == key.split("_")[1]
    for wrong in (key[:-1] + ("A" if key[-1] != "A" else "B"), "s2s_" + key.split("_")[1] + "_x", "nonsense", ""):
        assert store.find(wrong) is None
    keys_main(["--db", str(db), "remove", key])  # the whole key works too, and is not echoed
    assert key not in capsys.readouterr().err
    assert store.find(key) is None
    with pytest.raises(SystemExit) as exit:
        keys_main(["--db", str(db), "remove", "deadbeef"])
    assert exit.value.code == 1 and "has no key 'deadbeef'" in capsys.readouterr().err


@pytest.mark.parametrize("problem", ["missing", "read-only", "not ours", "not sqlite"])
def test_a_key_database_that_cannot_be_used_is_one_line(tmp_path: Path, problem: str, capsys: pytest.CaptureFixture):
    db = tmp_path / "keys.db"
    if problem != "missing":
        new_key(db, capsys=capsys)
    if problem == "read-only":
        db.chmod(0o444)
    elif problem == "not ours":
        db.unlink()
        sqlite3.connect(db).execute("CREATE TABLE other (x)")
    elif problem == "not sqlite":
        db.write_text("hello\n")
    with pytest.raises(AccessError) as error:
        Gate(keys_path=db)
    assert str(db) in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(SystemExit) as exit:  # the server: before any model loads (the checkpoint need not exist)
        server_main(["--checkpoint", str(tmp_path / "none.ckpt"), "--api-keys", str(db)])
    assert exit.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith("python -m seq2seq.serve: error: --api-keys ") and str(db) in message
    if problem == "missing":
        assert "keys --db" in message and "add" in message


def test_windows_per_key_and_per_address(tmp_path: Path, capsys: pytest.CaptureFixture):
    db = tmp_path / "keys.db"
    limited = new_key(db, "--req-limit", "3", "--char-limit", "100", capsys=capsys)
    defaults = new_key(db, capsys=capsys)  # the server's limits
    clock = Clock()
    gate = Gate(keys_path=db, limits=Limits(req_limit=5), clock=clock)
    with pytest.raises(Refused) as missing:
        gate.admit(key=None, address="10.0.0.1", characters=1)
    assert missing.value.status == 401
    with pytest.raises(Refused) as wrong:
        gate.admit(key=limited + "x", address="10.0.0.1", characters=1)
    assert wrong.value.status == 403
    for _ in range(3):
        gate.admit(key=limited, address="10.0.0.1", characters=10)
    clock.now += 59.5
    with pytest.raises(Refused) as over:
        gate.admit(key=limited, address="10.0.0.2", characters=10)  # another address: the key's count
    assert over.value.status == 429 and over.value.retry_after == 1 and "3 requests a minute" in str(over.value)
    for _ in range(5):
        gate.admit(key=defaults, address="10.0.0.1", characters=10)  # another key: its own window, 5 (the server's)
    with pytest.raises(Refused):
        gate.admit(key=defaults, address="10.0.0.1", characters=10)
    clock.now += 0.5  # the next minute
    gate.admit(key=limited, address="10.0.0.1", characters=60)
    with pytest.raises(Refused) as chars:  # 10 x 3 + 60 + 20 > 100 characters today
        gate.admit(key=limited, address="10.0.0.1", characters=20)
    assert "100 characters a day" in str(chars.value) and chars.value.retry_after == 86_400 - 60
    gate.admit(key=limited, address="10.0.0.1", characters=10)  # a refused request was not counted: 100 exactly
    with pytest.raises(Refused) as too_big:
        gate.admit(key=limited, address="10.0.0.1", characters=101)
    assert too_big.value.retry_after is None  # never: no Retry-After to wait for
    addresses = Gate(limits=Limits(req_limit=2), clock=clock)  # no keys: per client address, in memory
    for address in ("a", "a", "b", "b"):
        addresses.admit(key="ignored", address=address, characters=1)
    with pytest.raises(Refused):
        addresses.admit(key=None, address="a", characters=1)


def test_processes_share_the_counts_of_one_file(tmp_path: Path):
    """Three processes charging one address through one --limits-db file: 30 of their 60 requests admitted."""
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from seq2seq.serve.access import Gate, Limits, Refused
        gate = Gate(limits_path=Path({str(tmp_path / 'limits.db')!r}), limits=Limits(req_limit=30),
                    clock=lambda: 1_800_000_010.0)
        served = 0
        for _ in range(20):
            try:
                gate.admit(key=None, address="10.0.0.9", characters=5)
                served += 1
            except Refused:
                pass
        print(served)
        """)
    Gate(limits_path=tmp_path / "limits.db")  # created once, before the processes race to it
    processes = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    served = [int(p.communicate(timeout=60)[0]) for p in processes]
    assert sum(served) == 30, served


def test_a_database_gone_read_only_while_serving_is_a_503(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch):
    db = tmp_path / "keys.db"
    key = new_key(db, "--req-limit", "10", capsys=capsys)
    gate = Gate(keys_path=db)
    db.chmod(0o444)  # made read-only since the start: the gate's connection is now one that cannot write
    monkeypatch.setattr(gate, "db", connect(db, write=False))
    monkeypatch.setattr(gate, "keys", KeyStore(gate.db))
    with pytest.raises(Refused) as error:
        gate.admit(key=key, address="x", characters=1)
    assert error.value.status == 503 and "readonly" in str(error.value.__cause__)


@pytest.fixture(scope="module")
def translator(trained: Path) -> Translator:
    return Translator.from_checkpoint(trained, precision="fp32")


def test_keys_and_limits_hold_under_load(translator: Translator, tmp_path: Path, capsys: pytest.CaptureFixture):
    """A real server with --api-keys: 60 requests at once with a key allowed 10 a minute (10 served, the rest 429
    with Retry-After), 20 with a key allowed 100 (all served), none or a wrong key refused; the secret never in the
    server's output."""
    db = tmp_path / "keys.db"
    small = new_key(db, "--req-limit", "10", capsys=capsys)
    large = new_key(db, "--req-limit", "100", capsys=capsys)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    running = Running(create_app(translator, max_wait=0.01, gate=Gate(keys_path=db, clock=Clock())))
    try:
        url = running.url + "/translate"

        def send(kind: str) -> httpx.Response:
            body = {"q": SENTENCES[0], "source": "en", "target": "de"}
            if kind == "small-body":
                body["api_key"] = small
                return httpx.post(url, json=body, timeout=60)
            key = small if kind == "small" else large
            return httpx.post(url, json=body, headers={"authorization": f"Bearer {key}"}, timeout=60)

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(send, ["small", "large", "small-body"] * 20))
        small_answers = [a for kind, a in zip(["small", "large", "small-body"] * 20, answers, strict=True)
                         if kind != "large"]
        large_answers = answers[1::3]
        assert sorted(a.status_code for a in small_answers) == [200] * 10 + [429] * 30
        refused = [a for a in small_answers if a.status_code == 429]
        assert all(1 <= int(a.headers["retry-after"]) <= 60 and "10 requests a minute" in a.json()["error"]
                   for a in refused)
        assert [a.status_code for a in large_answers] == [200] * 20
        assert len({a.json()["translatedText"] for a in answers if a.status_code == 200}) == 1
        none = httpx.post(url, json={"q": "x", "source": "en", "target": "de"})
        assert none.status_code == 401 and none.headers["www-authenticate"] == "Bearer"
        wrong = httpx.post(url, json={"q": "x", "source": "en", "target": "de", "api_key": large[:-2]})
        assert wrong.status_code == 403 and "not valid" in wrong.json()["error"]
        for header in ("Basic Zm9vOmJhcg==", "Bearer", "Token abc"):
            malformed = httpx.post(url, json={"q": "x", "source": "en", "target": "de"},
                                   headers={"authorization": header})
            assert malformed.status_code == 400 and "Bearer" in malformed.json()["error"]
        assert httpx.get(running.url + "/languages").status_code == 200  # the languages need no key
        settings = httpx.get(running.url + "/frontend/settings").json()
        assert settings["keyRequired"] is True
    finally:
        running.stop()
        torch.set_num_threads(threads)
    output = capsys.readouterr()
    assert small not in output.out + output.err and large not in output.out + output.err


def test_the_keys_command_as_a_user_runs_it(tmp_path: Path, capsys: pytest.CaptureFixture):
    db = tmp_path / "keys.db"
    added = subprocess.run([sys.executable, "-m", "seq2seq.serve", "keys", "--db", str(db), "add", "--req-limit", "5"],
                           capture_output=True, text=True, timeout=60)
    assert added.returncode == 0 and added.stdout.startswith("s2s_") and "shown only now" in added.stderr
    for argv, message in ((["--db", str(db), "add", "--req-limit", "0"], "--req-limit must be at least 1, got 0"),
                          (["--db", str(tmp_path / "no.db"), "list"], "no such key database")):
        with pytest.raises(SystemExit) as exit:  # (in this process: a start of Python and the package is seconds)
            keys_main(argv)
        error = capsys.readouterr().err.strip()
        assert exit.value.code == 2 and len(error.splitlines()) == 1 and message in error

