"""What the epoch server accepts (pure: the real CLI parser, no server, no Spark), and its
token file."""
from __future__ import annotations

import os

import pytest

from ipcount.cli import build_parser
from ipcount.rules.config import CALLER_SETTINGS, PER_RUN_SETTINGS, PipelineConfig
from ipcount.rules.errors import BadRequestError, EpochServerError
from ipcount.server import auth
from ipcount.server.vetting import MAX_EPOCHS, Pipelines, command_line, parser_of

SERVED = PipelineConfig(pipeline_id="web", topic="access_log", warehouse="/srv/warehouse",
                        bootstrap_servers="kafka-1:9092,kafka-2:9092", max_records_per_epoch=1_000)
PARSE = parser_of(build_parser)


def line(*args: str, pipelines=None) -> list[str]:
    return command_line(list(args), PARSE, pipelines or Pipelines(SERVED))


def test_the_operator_s_command_runs_with_the_served_settings_first_and_the_request_s_after():
    # What a DAG task sends: the pipeline's own flags, the run's Params, the task's flags.
    request = ["epoch", *SERVED.to_args(), "--max-records-per-epoch=90", "--no-commit-offsets",
               "--run-id", "manual__1", "--skip-offset-commit"]
    own_secret_files = ["--kafka-sasl-password-file=", "--kafka-ssl-client-pem="]
    assert line(*request) == ["epoch", *SERVED.to_args(), *request[1:], *own_secret_files]
    # Flags left out are the served pipeline's, not the defaults.
    args = PARSE(line("backfill", "--pipeline-id", "web", "--offsets", "0:0-10"))
    assert (args.warehouse, args.topic, args.offsets) == ("/srv/warehouse", "access_log", "0:0-10")


@pytest.mark.parametrize("flags, named", [
    (["--ledger-table", "/tmp/x"], "--ledger-table"),
    (["--ledger", "/tmp/x"], "--ledger-table"),       # argparse's abbreviation of --ledger-table
    (["--warehouse", "/"], "--warehouse"),
    (["--bootstrap-servers", "evil:9092"], "--bootstrap-servers"),
    (["--topic", "other"], "--topic"),
    (["--window-seconds", "60"], "--window-seconds"),
    (["--group-id", "other"], "--group-id"),
])
def test_a_request_cannot_change_what_the_served_pipeline_is(flags, named):
    with pytest.raises(BadRequestError, match=f"^{named}: the epoch server runs pipeline 'web'"):
        line("epoch", *SERVED.to_args(), *flags)


def test_the_kafka_login_s_secret_files_are_always_the_server_s_own(tmp_path):
    """A request names its caller's copies (a task writes them from a connection); the server
    drops them, so no request can make it read another file or log in as another identity."""
    own = tmp_path / "server.password"
    own.write_text("pw\n")
    own.chmod(0o600)
    served = SERVED.replace(kafka_security_protocol="SASL_SSL", kafka_sasl_mechanism="SCRAM-SHA-512",
                            kafka_sasl_username="web", kafka_sasl_password_file=str(own))
    request = ["epoch", *served.to_args(), "--kafka-sasl-password-file", "/run/ipcount/epoch-server.token",
               "--kafka-ssl-client-pem", "/home/someone/key.pem"]
    args = PARSE(line(*request, pipelines=Pipelines(served)))
    assert (args.kafka_sasl_password_file, args.kafka_ssl_client_pem) == (str(own), "")
    # The login itself (user, mechanism, protocol) is the served pipeline's, as any setting.
    with pytest.raises(BadRequestError, match="^--kafka-sasl-username: the epoch server runs pipeline 'web'"):
        line(*request, "--kafka-sasl-username", "admin", pipelines=Pipelines(served))


def test_a_served_value_starting_with_a_dash_passes_and_parses():
    served = SERVED.replace(topic="-events", kafka_security_protocol="SASL_PLAINTEXT", kafka_sasl_mechanism="PLAIN",
                            kafka_sasl_username="-svc", kafka_sasl_password_file="/srv/password")
    args = PARSE(line("epoch", *served.to_args(), "--run-id", "manual__1", pipelines=Pipelines(served)))
    assert (args.topic, args.kafka_sasl_username, args.run_id) == ("-events", "-svc", "manual__1")


def test_the_same_value_spelt_differently_is_the_same():
    assert line("epoch", "--pipeline-id", "web", "--window-seconds", "05", "--commit-offsets")[0] == "epoch"


def test_per_run_and_caller_settings_may_differ():
    per_run = ["--start-position", "specific", "--start-offsets", "0:5", "--on-data-loss", "skip",
               "--group-offsets-reset", "none", "--start-timestamp-ms", "5"]
    caller = ["--spark-master", "spark://elsewhere:7077", "--schedule", "@daily", "--epoch-server",
              "http://10.0.0.1:8765", "--command-timeout-seconds", "5", "--dagrun-timeout-seconds", "5",
              "--epoch-server-token-file", "/elsewhere/token"]
    assert line("epoch", "--pipeline-id", "web", *per_run, *caller)[-len(caller) - 2:-2] == caller
    # Every setting is one of the three kinds, and the DAG's Params are exactly the per-run ones.
    from ipcount.orchestration.dags import RUN_PARAMS
    assert tuple(RUN_PARAMS) == PER_RUN_SETTINGS and not set(PER_RUN_SETTINGS) & set(CALLER_SETTINGS)


@pytest.mark.parametrize("args, why", [
    ([], "runs epoch, backfill, rebuild; got 'nothing'"),
    (["verify"], "runs epoch, backfill, rebuild; got 'verify'"),
    (["serve", "--host", "0.0.0.0"], "got 'serve'"),
    (["epoch", "--pipeline-id", "web", "--config", "/etc/shadow"], "--config: .* cannot name a config file"),
    (["epoch", "--pipeline-id", "other"], "serves no pipeline 'other'"),
    (["epoch"], "serves no pipeline 'ipcount'"),  # no id: the default one, not this server's
    (["epoch", "--pipeline-id", "web", "--epochs", str(MAX_EPOCHS + 1)], "--epochs: at most"),
    (["epoch", "--pipeline-id", "web", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["epoch", "--help"], "bad flags for `epoch`"),
    (["epoch", "--pipeline-id", "web", "--window-seconds", "0"], "window_seconds must be"),
    (["epoch", *["--run-id", "x"] * 101], "at most 200 arguments"),
    (["epoch", "--run-id", "x" * 5000], "at most 4096 characters"),
])
def test_refusals_say_what_and_why(args, why):
    with pytest.raises(BadRequestError, match=why):
        line(*args)


def test_pipelines_in_the_directory_are_served_and_read_at_each_request(tmp_path):
    pipelines = Pipelines(SERVED, str(tmp_path))
    other = SERVED.replace(pipeline_id="p_other", topic="other", warehouse=str(tmp_path / "w"))
    with pytest.raises(BadRequestError, match="serves no pipeline 'p_other'"):
        line("epoch", *other.to_args(), pipelines=pipelines)
    Pipelines.add(tmp_path, other)
    assert line("epoch", *other.to_args(), pipelines=pipelines)[:3] == ["epoch", *other.to_args()[:2]]
    with pytest.raises(BadRequestError, match="--warehouse"):
        line("epoch", *other.to_args(), "--warehouse", "/srv/warehouse", pipelines=pipelines)
    # A file under another pipeline's name, and ids that are no file name, are refused.
    (tmp_path / "p_third.json").write_text((tmp_path / "p_other.json").read_text())
    with pytest.raises(BadRequestError, match="is for pipeline 'p_other', not 'p_third'"):
        pipelines("p_third")
    assert pipelines("../p_other") is None and pipelines(".p_other") is None
    (tmp_path / "p_bad.toml").write_text('window_seconds = "soon"\n')
    with pytest.raises(BadRequestError, match="pipeline file is invalid: .*window_seconds"):
        pipelines("p_bad")


def test_the_token_file_is_made_private_and_refused_when_others_may_read_it(tmp_path):
    path = tmp_path / "dir" / "token"
    token = auth.ensure_token(path)
    assert os.stat(path).st_mode & 0o777 == 0o600 and len(token) >= 40
    assert auth.ensure_token(path) == token == auth.read_token(path)  # made once
    assert auth.authorized(f"Bearer {token}", token)
    assert not auth.authorized(f"Bearer {token[:-1]}x", token) and not auth.authorized(None, token)
    assert not auth.authorized(f"Basic {token}", token) and not auth.authorized("Bearer", token)
    os.chmod(path, 0o644)
    with pytest.raises(EpochServerError, match=f"open to others \\(mode 644\\); make it private: chmod 600 {path}"):
        auth.read_token(path)
    with pytest.raises(EpochServerError, match="no epoch server token at .*: `ipcount serve` makes it"):
        auth.read_token(tmp_path / "missing")
    short = tmp_path / "short"
    short.write_text("abc\n")
    short.chmod(0o600)
    with pytest.raises(EpochServerError, match="at least 16 characters"):
        auth.read_token(short)
