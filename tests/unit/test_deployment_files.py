"""docker-compose.yml and the Dockerfile stay consistent with the code they deploy."""
from __future__ import annotations

import yaml

from ipcount.rules.config import REPO_ROOT, PipelineConfig


def _compose() -> dict:
    return yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())


def test_compose_pipeline_settings_are_valid_config():
    env = _compose()["x-ipcount-env"]
    values = {k[len("IPCOUNT_"):].lower(): v for k, v in env.items()}
    cfg = PipelineConfig.from_mapping(values)  # raises on an unknown or invalid setting
    assert cfg.bootstrap_servers == "kafka:9092" and cfg.warehouse == "/data/warehouse"


def test_compose_airflow_points_at_this_repos_dags_and_spark_master():
    services = _compose()["services"]
    env = services["airflow-scheduler"]["environment"]
    assert env["AIRFLOW__CORE__DAGS_FOLDER"] == "/opt/ipcount/dags"
    assert "spark://spark-master" in env["AIRFLOW_CONN_SPARK_DEFAULT"]
    assert "/data/warehouse" in " ".join(services["spark-worker"]["volumes"])
    assert services["kafka"]["image"].endswith(":4.1.1")  # the broker version bin/setup fetches


def test_image_fetches_jars_from_the_same_poms_as_setup():
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    setup = (REPO_ROOT / "bin" / "setup").read_text()
    for pom in ("kafka-broker", "spark-extras"):
        assert (REPO_ROOT / "jars" / f"{pom}.xml").is_file()
        assert pom in dockerfile and f"jars/{pom}.xml" in setup


def test_compose_epoch_server_is_what_the_airflow_tasks_point_at():
    services = _compose()["services"]
    server = services["epoch-server"]
    assert server["command"][:4] == ["python", "-m", "ipcount.cli", "serve"]
    port = server["command"][server["command"].index("--port") + 1]
    url = services["airflow-scheduler"]["environment"]["IPCOUNT_EPOCH_SERVER"]
    assert url == f"http://{server['hostname']}:{port}"
    assert PipelineConfig.from_mapping({"epoch_server": url}).epoch_server == url
    assert "/data/warehouse" in " ".join(server["volumes"])  # the driver reads the tables' logs


def test_compose_airflow_tasks_can_read_the_token_the_epoch_server_makes():
    compose = _compose()
    services = compose["services"]
    token_file = compose["x-ipcount-env"]["IPCOUNT_EPOCH_SERVER_TOKEN_FILE"]
    token_dir = token_file.rsplit("/", 1)[0]
    for name in ("epoch-server", "airflow-scheduler", "airflow-apiserver"):
        mounts = {v.split(":")[1]: v.split(":")[0] for v in services[name]["volumes"]}
        assert mounts.get(token_dir) == "secrets", name
        assert services[name]["environment"]["IPCOUNT_EPOCH_SERVER_TOKEN_FILE"] == token_file

