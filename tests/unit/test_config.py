"""Configuration: precedence, conversion and error messages that say what to fix."""
from __future__ import annotations

import pytest

from ipcount.cli import build_parser, load_config
from ipcount.rules.config import COMMAND_SETTINGS, PipelineConfig
from ipcount.rules.errors import ConfigError


def test_defaults_match_the_reference_job():
    cfg = PipelineConfig()
    assert (cfg.topic, cfg.window_seconds, cfg.allowed_lateness_seconds) == ("ip_count_source", 5, 5)
    assert cfg.counts_path.endswith("/warehouse/counts") and cfg.ledger_path.endswith("/warehouse/ledger")


def test_precedence_file_then_env_then_overrides(tmp_path):
    f = tmp_path / "p.toml"
    f.write_text('[ipcount]\ntopic = "from_file"\nwindow_seconds = 10\nmax_records_per_epoch = 7\n')
    env = {"IPCOUNT_WINDOW_SECONDS": "20", "IPCOUNT_COMMIT_OFFSETS": "false", "OTHER": "x"}
    cfg = PipelineConfig.load(config_file=f, environ=env, max_records_per_epoch="9")
    assert (cfg.topic, cfg.window_seconds, cfg.commit_offsets, cfg.max_records_per_epoch) == \
        ("from_file", 20, False, 9)


def test_the_environment_a_config_hands_to_airflow_loads_back_as_the_same_config():
    cfg = PipelineConfig(topic="t1", window_seconds=60, commit_offsets=False, start_offsets="0:5", spark_remote="")
    assert PipelineConfig.load(environ=cfg.to_env()) == cfg


def test_table_paths_follow_the_warehouse_unless_set():
    cfg = PipelineConfig(warehouse="/w", ledger_table="/elsewhere/ledger")
    assert (cfg.counts_path, cfg.ledger_path) == ("/w/counts", "/elsewhere/ledger")
    assert cfg.replace(warehouse="/v").counts_path == "/v/counts"


def test_a_relative_table_location_is_made_absolute_where_the_command_runs(tmp_path, monkeypatch):
    """The DAG's tasks, Spark's executors and the next command must find the same tables."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = PipelineConfig.load(environ={"IPCOUNT_WAREHOUSE": "w"}, counts_table="~/c")
    assert (cfg.warehouse, cfg.counts_table, cfg.ledger_path) == \
        (str(tmp_path / "w"), str(tmp_path / "home" / "c"), str(tmp_path / "w" / "ledger"))
    assert PipelineConfig.load(environ={}, **{k: v for k, v in cfg.to_dict().items()}) == cfg


@pytest.mark.parametrize("value, message", [
    ("s3:/bucket/w", "looks like a URI with one slash after its scheme"),
    ("  ", "starts or ends with blanks"), ("/w ", "starts or ends with blanks")])
def test_a_table_location_that_is_a_typo_is_refused(value, message):
    with pytest.raises(ConfigError, match=message):
        PipelineConfig(warehouse=value)


def test_an_absolute_location_is_kept_as_written():
    """(Its Asset URI must not change with an upgrade.)"""
    assert PipelineConfig(counts_table="/data/counts/").counts_table == "/data/counts/"


def test_tables_on_object_storage_keep_their_uri():
    cfg = PipelineConfig(warehouse="s3://bucket/prefix/")
    assert (cfg.counts_path, cfg.late_path) == ("s3://bucket/prefix/counts", "s3://bucket/prefix/late_records")
    assert cfg.for_target("r1").ledger_path == "s3://bucket/prefix/replays/r1/ledger"
    assert PipelineConfig(warehouse="/w").for_target("r1").ledger_path == "/w/replays/r1/ledger"


@pytest.mark.parametrize("changes, message", [
    ({"window_seconds": 0}, "window_seconds must be an integer from 1 to 604800; found 0"),
    ({"window_seconds": 10**20}, "window_seconds must be an integer from 1 to 604800; found 100000000000000000000"),
    ({"window_seconds": "1e20"}, "window_seconds must be an integer; found '1e20'"),
    ({"window_seconds": 5.0}, "window_seconds must be an integer; found 5.0"),
    ({"kafka_timeout_seconds": "86400"}, "kafka_timeout_seconds must be an integer from 1 to 3600"),
    ({"bootstrap_servers": "h:0"}, "bootstrap_servers entry 'h:0': port 0 is not between 1 and 65535"),
    ({"bootstrap_servers": "h:9092,h:65536"}, "port 65536 is not between 1 and 65535"),
    ({"bootstrap_servers": "[::g]:9092"}, "'::g' in brackets is not an IPv6 address"),
    ({"bootstrap_servers": "::1:9092"}, "'::1:9092' is not host:port"),
    ({"spark_remote": "sc://h:70000"}, "port 70000 is not between 1 and 65535"),
    ({"spark_remote": "sc://h:1;token=x"}, "with no ;parameters"),
    ({"spark_remote": "sc://"}, "spark_remote must be a Spark Connect URL"),
    ({"topic": 123}, "topic must be a string; found 123 (int): quote it in a config file"),
    ({"warehouse": ["/a", "/b"]}, "warehouse must be a string; found ['/a', '/b'] (list)"),
    ({"warehouse": {"path": "/a"}}, "warehouse must be a string; found {'path': '/a'} (dict)"),
    ({"warehouse": "/tmp/a\nb"}, "warehouse holds a control character (a line break or tab?)"),
    ({"commit_offsets": 1}, "commit_offsets must be true or false; found 1"),
    ({"start_position": "middle"}, "start_position must be one of earliest, latest, timestamp, group-offsets, specific; found 'middle'"),
    ({"bootstrap_servers": "localhost"}, "bootstrap_servers entry 'localhost' is not host:port"),
    ({"topic": "bad topic"}, "topic must be a legal Kafka topic name"),
    ({"pipeline_id": "1abc"}, "pipeline_id must start with a letter"),
    ({"max_records_per_epoch": "lots"}, "max_records_per_epoch must be an integer; found 'lots'"),
    ({"commit_offsets": "perhaps"}, "commit_offsets must be true or false; found 'perhaps'"),
    ({"windw_seconds": 3}, "unknown setting(s) windw_seconds"),
    ({"warehouse": "gs://bucket/w"}, "warehouse 'gs://bucket/w': tables live in a directory or under s3://, s3a://"),
    ({"counts_table": "hdfs://nn/counts"}, "counts_table 'hdfs://nn/counts'"),
    ({"schedule": "every minute"}, "schedule 'every minute' is not a cron expression Airflow takes"),
    ({"schedule": "61 * * * *"}, "schedule '61 * * * *' is not a cron expression"),
    ({"schedule": "@once"}, "schedule '@once' is not a cron expression"),
    ({"on_data_fallback": "hourly"}, "on_data_fallback 'hourly': expected a cron expression or preset"),
    ({"on_data_fallback": "@continuous"}, "on_data_fallback '@continuous': expected a cron expression"),
    ({"maintenance_schedule": "@fortnightly"}, "maintenance_schedule '@fortnightly' is not a cron expression"),
])
def test_bad_settings_are_named_with_the_value_found(changes, message):
    with pytest.raises(ConfigError) as e:
        PipelineConfig.from_mapping(changes)
    assert message in str(e.value)


@pytest.mark.parametrize("schedule", ["* * * * *", "*/5 * * * *", "0 0 * * 1-5", "@hourly", "@daily", "@weekly",
                                      "@monthly", "@quarterly", "@yearly", "@continuous", "on-data"])
def test_schedules_airflow_takes_are_taken(schedule):
    assert PipelineConfig(schedule=schedule, on_data_fallback="none", maintenance_schedule="none").schedule == schedule
    if schedule not in ("@continuous", "on-data"):
        assert PipelineConfig(on_data_fallback=schedule, maintenance_schedule=schedule).on_data_fallback == schedule


@pytest.mark.parametrize("value", ["[::1]:9092", "kafka-0.example.com:9093,10.0.0.7:9092, [fe80::1%eth0]:19092",
                                   "h:1", "h:65535"])
def test_bootstrap_servers_in_every_legal_form_are_taken(value):
    assert PipelineConfig(bootstrap_servers=value).bootstrap_servers == value


@pytest.mark.parametrize("url", ["sc://localhost:15002", "sc://localhost", "sc://[::1]:15002", "sc://[::1]/"])
def test_spark_connect_urls_in_every_legal_form_are_taken(url):
    assert PipelineConfig(spark_remote=url).spark_remote == url


def test_every_int_setting_states_its_range_and_its_param_schema_carries_it():
    from ipcount.orchestration.dags import param_schema
    from ipcount.rules.config import SETTINGS

    for s in SETTINGS:
        if s.type == "int":
            assert s.minimum is not None and s.maximum is not None and s.minimum <= s.default <= s.maximum, s.name
            if s.scope == "run":
                assert (param_schema(s)["minimum"], param_schema(s)["maximum"]) == (s.minimum, s.maximum)


@pytest.mark.parametrize("env, message", [
    ({"IPCOUNT_WINDOW_SECOND": "10"},
     "environment variable IPCOUNT_WINDOW_SECOND is no setting of the pipeline (did you mean IPCOUNT_WINDOW_SECONDS?)"),
    ({"IPCOUNT_topic": "t"}, "environment variable IPCOUNT_topic is no setting of the pipeline (did you mean "
                             "IPCOUNT_TOPIC?)"),
    ({"IPCOUNT_CONFIG": ""}, "IPCOUNT_CONFIG is set but empty"),
    ({"IPCOUNT_CONFIG": "  "}, "IPCOUNT_CONFIG is set but empty"),
])
def test_a_variable_the_pipeline_would_not_read_is_refused(env, message):
    with pytest.raises(ConfigError) as e:
        PipelineConfig.load(environ=env)
    assert message in str(e.value)


def test_the_variables_beside_the_settings_are_not_refused():
    env = {"IPCOUNT_CRASH_AT": "after_plan", "IPCOUNT_S3_SECRET": "x", "IPCOUNT_TOPIC": "t", "IPCOUNTX": "y"}
    assert PipelineConfig.load(environ=env).topic == "t"


def test_a_config_path_that_is_empty_a_directory_or_a_device_is_refused_as_such(tmp_path):
    with pytest.raises(ConfigError, match="--config is empty"):
        PipelineConfig.load(config_file="", environ={})
    with pytest.raises(ConfigError, match="is a directory; expected a .toml or .json file"):
        PipelineConfig.load(config_file=tmp_path, environ={})
    with pytest.raises(ConfigError, match="is not a regular file"):
        PipelineConfig.load(config_file="/dev/null", environ={})


def test_a_toml_file_of_wrongly_typed_values_is_refused(tmp_path):
    f = tmp_path / "p.toml"
    f.write_text('topic = 123\n')
    with pytest.raises(ConfigError, match="topic must be a string; found 123"):
        PipelineConfig.load(config_file=f, environ={})


@pytest.mark.parametrize("text, message", [
    ("fetch.max.byte=5", "'fetch.max.byte' is no property of Kafka's consumer (did you mean fetch.max.bytes?)"),
    ("group.id=mine", "group.id is set by the pipeline from the epoch's read"),
    ("sasl.jaas.config=x", "sasl.jaas.config is set by the pipeline from the kafka_security_protocol, kafka_sasl_*"),
    ("ssl.cipher.suites=x", "ssl.cipher.suites is set by the pipeline from the kafka_security_protocol"),
    ("security.providers=x", "security.providers is set by the pipeline from"),
    ("client.rack", "entry 'client.rack' is not name=value"),
    ("client.rack=a;client.rack=b", "names client.rack twice"),
])
def test_consumer_properties_are_checked_against_kafkas_names(text, message):
    with pytest.raises(ConfigError) as e:
        PipelineConfig(kafka_consumer_properties=text)
    assert message in str(e.value)


def test_consumer_properties_reach_the_java_clients_after_the_security_ones_are_set():
    from ipcount.rules.kafka_properties import refused_property
    from ipcount.rules.kafka_security import spark_kafka_options

    cfg = PipelineConfig(kafka_consumer_properties=" fetch.max.bytes = 1048576 ; client.rack=eu-1a;")
    assert spark_kafka_options(cfg, None) == {"kafka.fetch.max.bytes": "1048576", "kafka.client.rack": "eu-1a",
                                              "kafka.security.protocol": "PLAINTEXT"}
    said = ("py4j...\nCaused by: org.apache.kafka.common.config.ConfigException: Invalid value soon for "
            "configuration metadata.max.age.ms: Not a number of type LONG\n\tat org.apache...")
    passed = "metadata.max.age.ms=soon"
    assert refused_property(said, passed) == ("Kafka's consumer refused metadata.max.age.ms=soon (Not a number of "
                                              "type LONG): check kafka_consumer_properties")
    assert refused_property(said, "") is None  # not a value the setting passed
    assert refused_property("java.lang.OutOfMemoryError", passed) is None


def test_bad_config_file_is_reported(tmp_path):
    f = tmp_path / "p.toml"
    f.write_text("topic = [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        PipelineConfig.load(config_file=f, environ={})
    with pytest.raises(ConfigError, match="does not exist"):
        PipelineConfig.load(config_file=tmp_path / "missing.toml", environ={})


@pytest.mark.parametrize("name, content, message", [
    ("p.json", b'{"ipcount": 5}', "'ipcount' must be a JSON object of settings (e.g. {\"ipcount\": {\"topic\": \"...\"}}); found int"),
    ("p.toml", b'ipcount = "x"', "'ipcount' must be a TOML table of settings (e.g. [ipcount] then topic"),
    ("p.json", b'[1, 2]', "must hold a JSON object of settings; found list"),
    ("p.toml", b'topic = "\xff\xfe"', "is not UTF-8 text (byte 9 cannot be read)"),
    ("p.json", b"[" * 100_000, "is not valid JSON"),
])
def test_a_config_file_of_the_wrong_shape_is_refused_with_what_to_fix(tmp_path, name, content, message):
    f = tmp_path / name
    f.write_bytes(content)
    with pytest.raises(ConfigError) as e:
        PipelineConfig.load(config_file=f, environ={})
    assert message in str(e.value)


@pytest.mark.parametrize("name, content, table", [
    ("p.toml", 'topic = "top"\nwindow_seconds = 10\n[ipcount]\ntopic = "table"\n', "[ipcount] table"),
    ("p.json", '{"topic": "top", "window_seconds": 10, "ipcount": {"topic": "table"}}', '"ipcount" object'),
])
def test_a_config_file_with_settings_at_top_level_and_under_ipcount_is_refused(tmp_path, name, content, table):
    """One of the two places would otherwise be ignored without a word."""
    f = tmp_path / name
    f.write_text(content)
    with pytest.raises(ConfigError) as e:
        PipelineConfig.load(config_file=f, environ={})
    assert (f"config file {str(f)!r} has top-level key(s) topic, window_seconds besides its {table}; put all "
            "the settings in one place") in str(e.value)


def test_cli_flags_round_trip_through_to_args():
    cfg = PipelineConfig(topic="t", commit_offsets=False, window_seconds=7)
    args = build_parser().parse_args(["epoch", *cfg.to_args()])
    assert load_config(args) == cfg


def test_values_starting_with_a_dash_round_trip_through_to_args(tmp_path):
    """A legal topic or user name may start with '-'; as a separate argument argparse would
    take it for a flag."""
    cfg = PipelineConfig(topic="-events", kafka_security_protocol="SASL_PLAINTEXT", kafka_sasl_mechanism="PLAIN",
                         kafka_sasl_username="-svc", kafka_sasl_password_file=str(tmp_path / "password"))
    args = build_parser().parse_args(["epoch", *cfg.to_args()])
    assert load_config(args) == cfg
    assert {"--topic=-events", "--kafka-sasl-username=-svc", "--counts-table="} <= set(cfg.to_args())


def test_cli_rejects_bad_values_with_exit_code_2(capsys):
    from ipcount.cli import main

    with pytest.raises(SystemExit) as e:
        main(["config", "--window-seconds", "-1"])
    assert e.value.code == 2
    assert "window_seconds must be an integer from 1 to 604800; found -1" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["generate", "--rate", "0"], ["generate", "--rate", "nan"],
                                  ["generate", "--count", "0"], ["chaos", "--kills", "0"]])
def test_cli_refuses_values_that_would_divide_by_zero_or_do_nothing(args, capsys):
    from ipcount_lab.cli import main as lab

    with pytest.raises(SystemExit) as e:
        lab(args)
    assert e.value.code == 2 and f"argument {args[1]}" in capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(COMMAND_SETTINGS))
def test_a_command_takes_only_the_settings_flags_it_reads(command, capsys):
    from ipcount_lab.cli import COMMANDS as LAB_COMMANDS

    parser = build_parser(LAB_COMMANDS if command in LAB_COMMANDS else None)
    extra = {"scram-user": ["--username", "u", "--password-file", "f"],
             "connect-server": ["--token-file", "f"]}.get(command, [])
    cfg = PipelineConfig(topic="t", warehouse="/w", window_seconds=30, publish=True)
    args = parser.parse_args([command, *extra, *cfg.to_args(COMMAND_SETTINGS[command])])
    own = load_config(args)
    assert {n: getattr(own, n) for n in COMMAND_SETTINGS[command]} == \
        {n: getattr(cfg, n) for n in COMMAND_SETTINGS[command]}
    ignored = next(s for s in ("window_seconds", "spark_master") if s not in COMMAND_SETTINGS[command])
    with pytest.raises(SystemExit) as e:
        parser.parse_args([command, *extra, f"--{ignored.replace('_', '-')}=5"])
    assert e.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_a_command_that_reads_no_setting_is_not_stopped_by_a_bad_one(monkeypatch):
    """The Connect server's container may share an environment with the pipeline's tasks."""
    monkeypatch.setenv("IPCOUNT_WINDOW_SECONDS", "-1")
    parser = build_parser()
    assert load_config(parser.parse_args(["connect-server", "--token-file", "f"])) == PipelineConfig()
    with pytest.raises(ConfigError, match="window_seconds must be an integer from 1 to 604800; found -1"):
        load_config(parser.parse_args(["watch"]))


def test_the_commands_that_hand_settings_on_take_them_all():
    """The DAGs hand every setting to epoch, backfill and rebuild (``cfg.to_args()``)."""
    cfg = PipelineConfig(topic="t", window_seconds=30, spark_master="local[2]")
    for command, own in (("epoch", []), ("backfill", ["--offsets", "0:0-5"]), ("rebuild", ["--into", "r"]),
                         ("config", [])):
        assert load_config(build_parser().parse_args([command, *own, *cfg.to_args()])) == cfg, command


@pytest.mark.parametrize("expression", ["* * * * *", "*/5 * * * *", "0 0 * * 1-5", "@hourly", "@quarterly", "@yearly",
                                        "every minute", "61 * * * *", "@once", "@fortnightly", "* * *"])
def test_the_cron_check_agrees_with_airflow(expression):
    from airflow.exceptions import AirflowTimetableInvalid
    from airflow.timetables.interval import CronDataIntervalTimetable

    from ipcount.rules.config import is_cron

    try:
        CronDataIntervalTimetable(expression, timezone="UTC").validate()
        taken = True
    except AirflowTimetableInvalid:
        taken = False
    assert is_cron(expression) == taken


def test_every_setting_declares_its_use_and_the_checks_follow_it():
    """What a setting is for is declared with it: one left unclassified fails at import, and
    a setting declared as meaning is recorded in (and checked against) a table set's manifest."""
    from ipcount.rules.config import MEANING, SETTINGS, USES, Setting
    from ipcount.rules.tableset import manifest

    assert all(s.use in USES for s in SETTINGS) and set(USES) == {s.use for s in SETTINGS}
    with pytest.raises(TypeError, match="setting x must declare its use"):
        Setting("x", "str", "", "a setting nobody classified")
    props = manifest(PipelineConfig(), {name: "id" for name in ("ledger_table_id", "counts_table_id",
                                                               "dead_letter_table_id", "late_table_id")})
    recorded = {key.removeprefix("ipcount.") for key in props}
    assert set(MEANING) == {"topic", "window_seconds", "allowed_lateness_seconds", "event_time", "max_value_bytes",
                            "max_event_time_ahead_seconds"} <= recorded
