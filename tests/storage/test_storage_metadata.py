"""Run metadata under /meta: what is recorded, once, and that secrets never reach the file."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import torch

from vartrace.storage import H5PYSaverCallback, open_run
from vartrace.storage.metadata import looks_secret
from vartrace.trace import RunContext, Trace

SECRETS = {
    "TORCH_MY_TOKEN": "s3cr3t-torch-token-5f1e2d",
    "HF_TOKEN": "hf_s3cr3tHuggingFaceValue9c8b",
    "WANDB_API_KEY": "wandb-s3cr3t-key-77aa",
    "SLURM_JOB_PASSWORD": "slurm-s3cr3t-pass-3141",
    "NCCL_Auth_Header": "nccl-s3cr3t-auth-2718",
    "CUDA_CREDENTIALS_FILE": "cuda-s3cr3t-cred-1618",
}
ARGV_SECRETS = {"--api-key": "argv-s3cr3t-apikey-4242", "--hf_token": "argv-s3cr3t-hf-5353"}

_WRITER = """
import sys
from vartrace.storage import H5PYSaverCallback
from vartrace.trace import RunContext, Trace
saver = H5PYSaverCallback(sys.argv[1])
saver.on_start(RunContext(rank=0, world_size=4))
trace = Trace()
trace.append(1.5, 1, 0, 0)
saver("forward.x", trace)
saver.close()
"""


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def _write_in_subprocess(path: Path, cwd: Path, env: dict[str, str], args: list[str]) -> None:
    script = cwd / "writer.py"
    script.write_text(_WRITER)
    subprocess.run(
        [sys.executable, str(script), str(path), *args],
        cwd=cwd,
        env={**os.environ, **env},
        check=True,
        timeout=120,
    )


def _assert_absent(raw: bytes, secrets: list[str]) -> None:
    """No secret appears in the file's bytes, in any encoding HDF5 or numpy might use."""
    for secret in secrets:
        for encoding in ("utf-8", "utf-16-le", "utf-16-be"):
            assert secret.encode(encoding) not in raw, f"{secret} leaked into the file"


def test_secret_values_planted_in_the_environment_and_argv_never_reach_the_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.h5"
    allowed = {
        "CUDA_VISIBLE_DEVICES": "3,1",
        "OMP_NUM_THREADS": "7",
        "TORCH_SHOW_CPP_STACKTRACES": "1",
        "MASTER_PORT": "29511",
    }
    args = [part for option, value in ARGV_SECRETS.items() for part in (f"{option}={value}",)]
    args += ["--token", "argv-s3cr3t-spaced-6464", "--epochs", "3"]
    _write_in_subprocess(path, tmp_path, {**SECRETS, **allowed, "UNLISTED_VAR": "not-kept"}, args)
    raw = path.read_bytes()
    planted = [*SECRETS.values(), *ARGV_SECRETS.values(), "argv-s3cr3t-spaced-6464"]
    _assert_absent(raw, planted)
    with open_run(path) as run:
        env = run.meta["env"]
        command = run.meta["command"]
    for name, value in allowed.items():
        assert env[name] == value
    assert not set(SECRETS) & set(env) and "UNLISTED_VAR" not in env
    assert command[2:] == [
        "--api-key=<redacted>",
        "--hf_token=<redacted>",
        "--token",
        "<redacted>",
        "--epochs",
        "3",
    ]


def test_metadata_records_the_run_context_and_git_state(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "trunk")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "T")
    (repo / "train.py").write_text("lr = 0.1\n")
    (repo / "zz_big.txt").write_text("x\n" * 10)
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "start")
    commit = _git(repo, "rev-parse", "HEAD")
    (repo / "train.py").write_text("lr = 0.2\n")
    (repo / "zz_big.txt").write_text("y" * 100 + "\n" + ("z" * 99 + "\n") * 12000)  # > 1 MiB diff
    path = tmp_path / "run.h5"
    _write_in_subprocess(path, repo, {}, [])
    with open_run(path) as run:
        meta = run.meta
    assert meta["cwd"] == str(repo)
    assert meta["world_size"] == 4
    assert meta["host"] and meta["pid"] > 0
    assert meta["command"][0].endswith("writer.py")
    started = datetime.datetime.fromisoformat(meta["start_time"])
    assert started.utcoffset() == datetime.timedelta(0)
    assert abs((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds()) < 600
    versions = meta["versions"]
    assert versions["python"] == sys.version
    assert {"torch", "numpy", "h5py", "vartrace", "hdf5"} <= set(versions)
    assert versions["h5py"] == h5py.__version__
    # The version users compare against, local tag included (``2.15.0+cu132``, ``2.13.0+cpu``).
    assert versions["torch"] == torch.__version__
    assert any(package.lower().startswith("h5py==") for package in meta["packages"])
    git = meta["git"]
    assert git["available"] and git["commit"] == commit and git["branch"] == "trunk"
    assert git["dirty"] is True
    assert "+lr = 0.2" in git["diff"]
    assert git["diff_truncated"] is True and len(git["diff"].encode()) <= (1 << 20) + 16
    assert "train.py" in git["status"]


def test_metadata_tolerates_a_directory_without_git(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    _write_in_subprocess(path, tmp_path, {"GIT_CEILING_DIRECTORIES": str(tmp_path.parent)}, [])
    with open_run(path) as run:
        assert run.meta["git"] == {"available": False}


def test_metadata_is_written_once_and_can_be_turned_off(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    for append in (False, True):
        with H5PYSaverCallback(path, append=append) as saver:
            saver.on_start(RunContext(world_size=2 if append else 1))
            trace = Trace()
            trace.append(1, 2 if append else 1, 0, 0)  # the appended run goes on at iteration 2
            saver("x", trace)
    with open_run(path) as run:
        assert run.meta["world_size"] == 1
    bare = tmp_path / "bare.h5"
    with H5PYSaverCallback(bare, metadata=False) as saver:
        trace = Trace()
        trace.append(1, 1, 0, 0)
        saver("x", trace)
    with open_run(bare) as run:
        assert run.meta == {}


def test_secret_looking_names() -> None:
    for name in ("HF_TOKEN", "aws_secret_access_key", "DB_PASSWORD", "NCCL_AUTH", "my-credential"):
        assert looks_secret(name)
    for name in ("--passphrase", "--pass", "--pw", "-p", "--db-pass", "DB_PASS_FILE", "--pwd"):
        assert looks_secret(name)
    for name in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MASTER_ADDR", "GIT_AUTHOR_NAME"):
        assert not looks_secret(name)
    for name in ("--num-passes", "--power", "--pos", "--proc", "-P"):
        assert not looks_secret(name)


# Realistic credentials, as users pass them: in URLs, after password-like options of any
# spelling, in hydra-style overrides, and as tokens of well-known shapes.
VALUE_SECRETS_ENV = {
    "VARTRACE_DB_URL": "postgresql://alice:Tr0ub4dor-and-3@db.internal:5432/runs",
    "TORCH_HUB_MIRROR": "https://ghp_R8x2kQ9vLmN4pT7wZ1yB3cD5fG6hJ0aS2uE@github.com/org/hub",
    "SLURM_JOB_COMMENT": "sync with s3 key AKIAIOSFODNN7EXAMPLE nightly",
}
VALUE_SECRETS_ARGV = [
    ("--passphrase", "correct horse battery staple"),
    ("--pass", "hunter2-Xq9"),
    ("--pw", "pw-9f8e7d6c"),
    ("-p", "mysql-R00t-pw"),
    ("--db-url", "mysql://root:S3cure!Pass@10.0.0.5/train"),
    ("--hub", "https://hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345@huggingface.co/org/model"),
]
VALUE_SECRETS_INLINE = [
    "--pw=inline-pw-5566",
    "-pAttachedMysqlPw77",
    "trainer.logger.password=hydra-pw-8899",
    "sk-proj-4f9Qx2LmZ8vB1nK7tR3wY6uE0aS5dH",
]


def test_credentials_inside_values_never_reach_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    args = [part for pair in VALUE_SECRETS_ARGV for part in pair]
    args += [*VALUE_SECRETS_INLINE, "--lr", "0.1", "--num-passes", "3"]
    _write_in_subprocess(path, tmp_path, VALUE_SECRETS_ENV, args)
    raw = path.read_bytes()
    planted = [value for _, value in VALUE_SECRETS_ARGV]
    planted += ["Tr0ub4dor-and-3", "AKIAIOSFODNN7EXAMPLE"]
    planted += ["ghp_R8x2kQ9vLmN4pT7wZ1yB3cD5fG6hJ0aS2uE"]
    planted += ["S3cure!Pass", "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345", "inline-pw-5566"]
    planted += ["AttachedMysqlPw77", "hydra-pw-8899", "sk-proj-4f9Qx2LmZ8vB1nK7tR3wY6uE0aS5dH"]
    _assert_absent(raw, planted)
    with open_run(path) as run:
        env = run.meta["env"]
        command = run.meta["command"]
    assert env["VARTRACE_DB_URL"] == "postgresql://<redacted>@db.internal:5432/runs"
    assert env["TORCH_HUB_MIRROR"] == "https://<redacted>@github.com/org/hub"
    assert env["SLURM_JOB_COMMENT"] == "sync with s3 key <redacted> nightly"
    assert command[2:] == [
        "--passphrase",
        "<redacted>",
        "--pass",
        "<redacted>",
        "--pw",
        "<redacted>",
        "-p",
        "<redacted>",
        "--db-url",
        "mysql://<redacted>@10.0.0.5/train",
        "--hub",
        "https://<redacted>@huggingface.co/org/model",
        "--pw=<redacted>",
        "-p<redacted>",
        "trainer.logger.password=<redacted>",
        "<redacted>",
        "--lr",
        "0.1",
        "--num-passes",
        "3",
    ]


# Fifteen realistic secrets: in the environment, on the command line and in an uncommitted
# diff (configs, code, a shell script, a private key), each as users write them.
DIFF_FILES = {
    "config.yaml": "db:\n  user: trainer\n  password: hunter2-Zq81xV\n",
    "settings.py": 'WANDB_API_KEY = "5f0c1e2d3b4a69788796a5b4c3d2e1f0a9b8c7d6"\nlr = 0.2\n',
    ".env": "export HF_TOKEN=hf_QwErTyUiOpAsDfGhJkLzXcVbNm123456\n",
    "secrets.json": '{"aws_secret_access_key": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"}\n',
    "notify.py": 'client = Client(token_value="xoxb-1234567890-abcdefghijklmn")\n',
    "fetch.py": 'auth = {"Authorization": "Bearer eyJhbGciOiJIUzI1NiJ9.cGF5bG9hZA.c2lnbmF0dXJl"}\n',
    "db.py": 'URL = "postgresql://admin:Adm1n-S3cret-77@db:5432/runs"\n',
    "id_rsa": "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEAx7Gq3kPrivateKeyBody9\n"
    "-----END RSA PRIVATE KEY-----\n",
    "run.sh": "python train.py --password 'Sup3r-Secret-Sh3ll'\n",
}
DIFF_SECRETS = [
    "hunter2-Zq81xV",
    "5f0c1e2d3b4a69788796a5b4c3d2e1f0a9b8c7d6",
    "hf_QwErTyUiOpAsDfGhJkLzXcVbNm123456",
    "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "xoxb-1234567890-abcdefghijklmn",
    "eyJhbGciOiJIUzI1NiJ9.cGF5bG9hZA.c2lnbmF0dXJl",
    "Adm1n-S3cret-77",
    "MIIEowIBAAKCAQEAx7Gq3kPrivateKeyBody9",
    "Sup3r-Secret-Sh3ll",
]
ENV_SECRETS = {
    "TORCH_HUB_TOKEN": "tok-9d8c7b6a5f4e3d2c",
    "VARTRACE_DB_URL": "mysql://ml:My-Sq1-Pw-4410@10.1.2.3/runs",
    "SLURM_JOB_COMMENT": "resume with api_key=ak-5566-7788-99aa",
}
ENV_PLANTED = ["tok-9d8c7b6a5f4e3d2c", "My-Sq1-Pw-4410", "ak-5566-7788-99aa"]
ARGV_PLANTED = ["wb-k3y-0a1b2c3d", "Hydra-Pw-1357", "ghp_Z9y8X7w6V5u4T3s2R1q0P9o8N7m6L5k4J3i2"]


def _dirty_repo(root: Path, files: dict[str, str] = DIFF_FILES) -> Path:
    """A real git repository with one commit and the texts of ``files`` uncommitted."""
    repo = root / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "T")
    for name in files:
        (repo / name).write_text("# placeholder\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "start")
    for name, text in files.items():
        (repo / name).write_text(text)
    return repo


def test_fifteen_secrets_in_argv_environment_and_uncommitted_diff_never_reach_the_file(
    tmp_path: Path,
) -> None:
    repo = _dirty_repo(tmp_path)
    path = tmp_path / "run.h5"
    args = ["--wandb-key", ARGV_PLANTED[0], f"model.db.password={ARGV_PLANTED[1]}"]
    args += [ARGV_PLANTED[2], "--epochs", "3"]
    _write_in_subprocess(path, repo, ENV_SECRETS, args)
    planted = [*DIFF_SECRETS, *ENV_PLANTED, *ARGV_PLANTED]
    assert len(planted) == 15
    _assert_absent(path.read_bytes(), planted)
    with open_run(path) as run:
        git = run.meta["git"]
    assert git["dirty"] is True
    assert "+lr = 0.2" in git["diff"]  # the diff is kept, only its secrets are redacted
    assert "+  password: <redacted>" in git["diff"].splitlines()
    assert '+WANDB_API_KEY = "<redacted>"' in git["diff"].splitlines()


_DIFFLESS_WRITER = """
import sys
from vartrace.storage import H5PYSaverCallback
from vartrace.trace import Trace
saver = H5PYSaverCallback(sys.argv[1], metadata={"git_diff": False})
trace = Trace()
trace.append(1.5, 1, 0, 0)
saver("forward.x", trace)
saver.close()
"""


def test_the_diff_can_be_left_out_alone(tmp_path: Path) -> None:
    repo = _dirty_repo(tmp_path)
    (repo / "settings.py").write_text("lr = 0.2  # marker-of-the-diff\n")
    script = tmp_path / "write.py"
    script.write_text(_DIFFLESS_WRITER)
    path = tmp_path / "run.h5"
    subprocess.run([sys.executable, str(script), str(path)], cwd=repo, check=True, timeout=120)
    assert b"marker-of-the-diff" not in path.read_bytes()
    with open_run(path) as run:
        meta = run.meta
    assert meta["git"]["commit"] == _git(repo, "rev-parse", "HEAD")
    assert meta["git"]["dirty"] is True and meta["git"]["diff_left_out"] is True
    assert "diff" not in meta["git"]
    assert meta["command"] and meta["versions"]["h5py"] == h5py.__version__
    with pytest.raises(TypeError, match=r"unknown metadata option\(s\) 'diff'; known: git_diff"):
        H5PYSaverCallback(tmp_path / "other.h5", metadata={"diff": False})


# Secrets as commands take them, planted where /meta records text: (where, text, secret).
# "diff:<file>" is a line of an uncommitted file, "argv" one command-line argument, "env:<name>"
# an allow-listed environment variable.  Each secret must be nowhere in the file.
PLANTED = [
    ("diff:db.sh", "mysql -u root -phunter2-Mq7 runs", "hunter2-Mq7"),
    ("diff:mysql.sh", "mysql -u root -p My-Sql-Sp4ced runs", "My-Sql-Sp4ced"),
    ("diff:deploy.sh", "sshpass -p 'Ssh-Pa55-91' ssh -p 22 deploy@host", "Ssh-Pa55-91"),
    ("diff:run.py", 'run(["sshpass", "-p", "List-Pw-7731", "ssh", "host"])', "List-Pw-7731"),
    ("diff:fetch.sh", "curl -u alice:Curl-Pw-8812 https://api.example.com", "Curl-Pw-8812"),
    ("diff:fetch2.sh", "curl -ubob:Curl-Att-2290 https://api.example.com", "Curl-Att-2290"),
    ("diff:netrc", "machine api.example.com login alice password Netrc-Pw-4417", "Netrc-Pw-4417"),
    ("diff:netrc2", "  password Netrc-Line-6620", "Netrc-Line-6620"),
    ("diff:enc.sh", "openssl enc -aes-256-cbc -k Ossl-K-5521 -in a -out b", "Ossl-K-5521"),
    ("diff:dec.sh", "openssl enc -d -pass pass:Ossl-Pass-6632 -in b", "Ossl-Pass-6632"),
    (
        "diff:publish.sh",
        "NPM_CONFIG=npm_Ab12Cd34Ef56Gh78Ij90Kl12 npm publish",
        "npm_Ab12Cd34Ef56Gh78Ij90Kl12",
    ),
    (
        "diff:upload.sh",
        "twine upload -u __token__ dist/* # pypi-AgEIcHlwaS5vcmcCJDFhYmMtZGVmZy0xMjM0",
        "pypi-AgEIcHlwaS5vcmcCJDFhYmMtZGVmZy0xMjM0",
    ),
    ("diff:remote.txt", "https://bob:Url-Pw-3390@git.example.com/r.git", "Url-Pw-3390"),
    ("diff:conf.ini", "password=Ini-Pw-1142", "Ini-Pw-1142"),
    ("diff:conf.yaml", "token: Yaml-Tok-5573", "Yaml-Tok-5573"),
    (
        "diff:key.txt",
        "ghp_Q1w2E3r4T5y6U7i8O9p0A1s2D3f4G5h6J7k8",
        "ghp_Q1w2E3r4T5y6U7i8O9p0A1s2D3f4G5h6J7k8",
    ),
    ("argv", "-pArgvMysql-2207", "ArgvMysql-2207"),
    ("argv", "carol:Argv-Curl-4455", "Argv-Curl-4455"),  # after "-u" (see _planted_argv)
    ("argv", "sshpass -p Argv-Nested-6678 ssh h", "Argv-Nested-6678"),
    ("argv", "npm_Zy98Xw76Vu54Ts32Rq10Po98", "npm_Zy98Xw76Vu54Ts32Rq10Po98"),
    ("env:VARTRACE_CMD", "mysql -u root -pEnv-Mysql-3344", "Env-Mysql-3344"),
    ("env:SLURM_JOB_COMMENT", "curl -u dan:Env-Curl-9921 https://x", "Env-Curl-9921"),
    ("env:VARTRACE_NETRC", "machine h login u password Env-Netrc-1188", "Env-Netrc-1188"),
    ("env:VARTRACE_OPENSSL", "openssl enc -k Env-Ossl-7765 -in a", "Env-Ossl-7765"),
]
# Ordinary lines of the same diff that are kept as they are.
KEPT = {
    "build.sh": ["mkdir -p checkpoints/run1", "gcc -pthread -O2 main.c", "pytest -k test_lr"],
    "requirements.txt": ["keyring==25.6.0", "tokenizers==0.21.0"],
    "notes.md": ["Author: Ada", "x = a - b"],
}
PACKAGE_TOKEN = "pypi-AgEIcHlwaS5vcmcPlantedInAPackageName0"


def _planted_argv() -> list[str]:
    args = []
    for where, text, _ in PLANTED:
        if where == "argv":
            args += ["-u", text] if text.startswith("carol:") else [text]
    return [*args, "--epochs", "3"]


def _strings(value: object) -> list[str]:
    """Every string inside a /meta value."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [text for item in value.values() for text in _strings(item)]
    if isinstance(value, (list, tuple)):
        return [text for item in value for text in _strings(item)]
    return []


def test_secrets_of_commands_in_diff_argv_environment_and_packages_never_reach_the_file(
    tmp_path: Path,
) -> None:
    files = {name: "\n".join(lines) + "\n" for name, lines in KEPT.items()}
    for where, text, _ in PLANTED:
        if where.startswith("diff:"):
            files[where.removeprefix("diff:")] = text + "\n"
    repo = _dirty_repo(tmp_path, files)
    env = {where.removeprefix("env:"): text for where, text, _ in PLANTED if "env:" in where}
    # A distribution whose name holds a token: the packages list is redacted too.
    site = tmp_path / "site"
    (site / "leaky-0.1.dist-info").mkdir(parents=True)
    (site / "leaky-0.1.dist-info" / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {PACKAGE_TOKEN}\nVersion: 0.1\n"
    )
    env["PYTHONPATH"] = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    path = tmp_path / "run.h5"
    _write_in_subprocess(path, repo, env, _planted_argv())
    secrets = [secret for _, _, secret in PLANTED] + [PACKAGE_TOKEN]
    _assert_absent(path.read_bytes(), secrets)
    with open_run(path) as run:
        meta = run.meta
    for text in _strings(meta):
        assert not [secret for secret in secrets if secret in text], text
    diff = meta["git"]["diff"].splitlines()
    for lines in KEPT.values():
        assert {f"+{line}" for line in lines} <= set(diff)
    for line in (
        "+mysql -u root -p<redacted> runs",
        "+mysql -u root -p <redacted> runs",
        "+sshpass -p '<redacted>' ssh -p <redacted> deploy@host",
        '+run(["sshpass", "-p", "<redacted>", "ssh", "host"])',
        "+curl -u alice:<redacted> https://api.example.com",
        "+machine api.example.com login alice password <redacted>",
        "+openssl enc -aes-256-cbc -k <redacted> -in a -out b",
        "+NPM_CONFIG=<redacted> npm publish",
    ):
        assert line in diff
    assert meta["command"][2:] == [
        "-p<redacted>",
        "-u",
        "carol:<redacted>",
        "sshpass -p <redacted> ssh h",
        "<redacted>",
        "--epochs",
        "3",
    ]
    assert meta["env"]["VARTRACE_CMD"] == "mysql -u root -p<redacted>"
    assert meta["env"]["SLURM_JOB_COMMENT"] == "curl -u dan:<redacted> https://x"
    assert "<redacted>==0.1" in meta["packages"]


# Secrets in a pair after other pairs, as connection strings and URL queries hold them:
# (argument, secret, the argument as /meta records it).
AFTER_PAIRS = [
    (
        "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=Azure-Key-7310==;"
        "EndpointSuffix=core.windows.net",
        "Azure-Key-7310==",
        "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=<redacted>",
    ),
    (
        "Server=db.local;Password=Odbc-Pw-4471;",
        "Odbc-Pw-4471",
        "Server=db.local;Password=<redacted>",
    ),
    (
        "jdbc:postgresql://h/db?user=bob&password=Jdbc-Pw-8823",
        "Jdbc-Pw-8823",
        "jdbc:postgresql://h/db?user=bob&password=<redacted>",
    ),
    (
        "https://api.example.com/v1/runs?token=Query-Tok-5519",
        "Query-Tok-5519",
        "https://api.example.com/v1/runs?token=<redacted>",
    ),
    ("user=bob;password=Semi-Pw-3362", "Semi-Pw-3362", "user=bob;password=<redacted>"),
    ("user=bob,password=Comma-Pw-2280", "Comma-Pw-2280", "user=bob,password=<redacted>"),
    ("--conn=AccountKey=Opt-Key-6604", "Opt-Key-6604", "--conn=AccountKey=<redacted>"),
]


def test_secrets_after_other_pairs_never_reach_the_file(tmp_path: Path) -> None:
    """A pair's unquoted value does not swallow the secret pair after it: every shape,
    planted through the real command line (alone and after an option), is nowhere in the
    file, and the pairs before it are kept."""
    args = [part for argument, _, _ in AFTER_PAIRS for part in (argument, "--conn", argument)]
    path = tmp_path / "run.h5"
    _write_in_subprocess(path, tmp_path, {}, [*args, "--epochs", "3"])
    secrets = [secret for _, secret, _ in AFTER_PAIRS]
    _assert_absent(path.read_bytes(), secrets)
    with open_run(path) as run:
        meta = run.meta
    for text in _strings(meta):
        assert not [secret for secret in secrets if secret in text], text
    kept = [part for _, _, text in AFTER_PAIRS for part in (text, "--conn", text)]
    assert meta["command"][2:] == [*kept, "--epochs", "3"]
