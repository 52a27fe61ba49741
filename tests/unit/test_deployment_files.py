"""docker-compose.yml and the Dockerfile stay consistent with the code they deploy."""
from __future__ import annotations

import os
import re
from pathlib import Path

import yaml

from ipcount.rules.config import REPO_ROOT, PipelineConfig


def _compose() -> dict:
    return yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())


def test_compose_pipeline_settings_are_valid_config():
    env = _compose()["x-ipcount-env"]
    values = {k[len("IPCOUNT_"):].lower(): v for k, v in env.items() if k.startswith("IPCOUNT_")}
    cfg = PipelineConfig.from_mapping(values)  # raises on an unknown or invalid setting
    assert cfg.bootstrap_servers == "kafka:9092" and cfg.warehouse == "s3://ipcount/warehouse"


def test_compose_airflow_points_at_this_repos_dags_and_spark_master():
    services = _compose()["services"]
    env = services["airflow-scheduler"]["environment"]
    assert env["AIRFLOW__CORE__DAGS_FOLDER"] == "/opt/ipcount/dags"
    assert "spark://spark-master" in env["AIRFLOW_CONN_SPARK_DEFAULT"]
    # the tasks commit to the tables; executors write large epochs' data files into the object
    # store (never a local volume), with the pipeline's own store settings
    assert "volumes" not in services["spark-worker"]
    store = {k: v for k, v in _compose()["x-ipcount-env"].items() if k.startswith("AWS_")}
    assert store and all(services["spark-worker"]["environment"][k] == v for k, v in store.items())
    assert services["spark-worker"]["deploy"]["replicas"] == 2            # as `bin/lab spark-cluster` starts
    assert services["kafka"]["image"].endswith(":4.1.1")  # the broker version bin/setup fetches


def test_compose_keeps_the_tables_in_its_object_store():
    compose = _compose()
    services, env = compose["services"], compose["x-ipcount-env"]
    bucket = env["IPCOUNT_WAREHOUSE"].removeprefix("s3://").split("/")[0]
    host, port = env["AWS_ENDPOINT_URL"].removeprefix("http://").split(":")
    store = services[host]["command"][-1]
    # the project's own server (ipcount_lab/embedded_s3.py, its default key id), for the
    # bucket and on the port the pipeline's settings name, its secret the pipeline's
    serve = store.split("exec ", 1)[1].split()
    assert serve[:4] == ["ipcount-lab", "s3", "serve", "--host"]
    flags = dict(zip(serve[3::2], serve[4::2]))
    assert (flags["--port"], flags["--bucket"]) == (port, bucket)
    assert f'> {flags["--state-dir"]}/secret' in store and "umask 077" in store
    assert services[host]["environment"]["S3_SECRET"] == env["AWS_SECRET_ACCESS_KEY"]
    from ipcount_lab.embedded_s3 import EmbeddedS3
    assert env["AWS_ACCESS_KEY_ID"] == EmbeddedS3.access_key_id
    for name in ("airflow-init", "airflow-scheduler", "airflow-apiserver", "airflow-triggerer"):
        assert services[name]["environment"]["AWS_ENDPOINT_URL"] == env["AWS_ENDPOINT_URL"]
        assert not any("warehouse" in v for v in services[name].get("volumes", [])), name
    # Airflow's other services start after airflow-init
    assert services["airflow-init"]["depends_on"][host] == {"condition": "service_healthy"}
    assert services["postgres"]["image"].startswith("postgres:")


def _stages() -> dict[str, str]:
    """The Dockerfile's stages by name, each its lines up to the next FROM."""
    stages, name = {}, None
    for line in (REPO_ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("FROM "):
            name = line.split(" AS ")[1].strip()
            stages[name] = ""
        if name:
            stages[name] += line + "\n"
    return stages


def test_image_fetches_jars_from_the_same_poms_as_setup():
    stages = _stages()
    setup = (REPO_ROOT / "bin" / "setup").read_text()
    for stage, pom in (("product", "kafka-broker"), ("product", "spark-extras"), ("lab", "s3proxy")):
        assert (REPO_ROOT / "jars" / f"{pom}.xml").is_file()
        assert pom in stages[stage] and f"jars/{pom}.xml" in setup
    assert "s3proxy" not in stages["product"]
    # The parse jar: built in a stage of its own from the POM bin/setup builds, copied where
    # spark_jars() looks for it.
    assert "-f jars/ipcount-parse/pom.xml" in stages["parse-jar"] and "jars/ipcount-parse" in setup
    assert ("COPY --from=parse-jar /opt/ipcount/.local/build/ipcount-parse/ipcount-parse.jar ./.local/jars/ipcount/"
            in stages["product"])


def test_the_parse_jar_compiles_against_the_pinned_spark():
    """jars/ipcount-parse's Spark is pyspark's: the function runs in that JVM."""
    pom = (REPO_ROOT / "jars" / "ipcount-parse" / "pom.xml").read_text()
    pin = re.search(r"^pyspark==(\S+)$", (REPO_ROOT / "requirements.txt").read_text(), re.M)
    assert pin and f"<spark.version>{pin.group(1)}</spark.version>" in pom


def test_the_product_image_holds_no_lab_and_compose_runs_each_service_on_its_image():
    stages = _stages()
    copied = [line.split()[1] for line in stages["product"].splitlines() if line.startswith("COPY ")]
    # the package as the product's wheel (built without the lab), and what it runs from IPCOUNT_HOME
    assert "IPCOUNT_DIST=product pip wheel --no-cache-dir --no-deps -w /wheels/product ." in stages["wheels"]
    assert "--from=wheels" in copied and "COPY --from=wheels /wheels/product /tmp/wheels" in stages["product"]
    assert "pip install --no-cache-dir --no-deps /tmp/wheels/*.whl" in stages["product"]
    for needed in ("dags", "plugins", "spark_jobs/epoch_job.py", "bin/kafka-consumer-groups"):
        assert needed in copied, needed
    assert "IPCOUNT_HOME=/opt/ipcount" in stages["product"] and "WORKDIR /opt/ipcount" in stages["product"]
    assert not any(path in (".", "ipcount", "ipcount_lab", "tests", "bin/lab") or path.startswith(("ipcount", "tests"))
                   for path in copied), copied
    # the lab: the wheel with the lab over the product's
    assert stages["lab"].startswith("FROM product AS lab") and "COPY --from=wheels /wheels/dev" in stages["lab"]
    for name, service in _compose()["services"].items():
        if "build" not in service:
            continue                                         # an upstream image (Kafka, PostgreSQL)
        command = " ".join(service.get("command", []))
        target = "lab" if "ipcount_lab" in command or "ipcount-lab" in command else "product"
        assert service["build"] == {"context": ".", "target": target}, name
        assert service["image"] == ("ipcount-lab:local" if target == "lab" else "ipcount:local"), name


def test_the_product_wheel_holds_the_product_alone(tmp_path):
    """The wheel the product image installs: the ``ipcount`` package with its templates and the
    ``ipcount`` command; none of the lab. Built from what the image's build stage copies."""
    import shutil
    import subprocess
    import sys
    import zipfile

    source = tmp_path / "src"           # a copy: a build leaves build/ and *.egg-info beside the sources
    for name in ("ipcount", "ipcount_lab"):
        shutil.copytree(REPO_ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.py", "README.md", "requirements.txt", "requirements-lab.txt"):
        shutil.copy(REPO_ROOT / name, source / name)
    env = {**os.environ, "IPCOUNT_DIST": "product"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(tmp_path), str(source)], env=env, check=True, capture_output=True)
    (wheel,) = tmp_path.glob("ipcount-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"ipcount", wheel.name.split("-py3")[0] + ".dist-info"}, tops
    assert "ipcount/orchestration/monitor/templates/epochs.html" in names
    shipped = {name for name in names if name.endswith(".py")}
    assert shipped == {str(p.relative_to(source)) for p in (source / "ipcount").rglob("*.py")}
    entry_points = zipfile.ZipFile(wheel).read(f"{wheel.name.split('-py3')[0]}.dist-info/entry_points.txt").decode()
    assert "ipcount = ipcount.cli:main" in entry_points and "ipcount_lab" not in entry_points


def test_the_product_command_line_loads_no_lab_module():
    import subprocess
    import sys

    probe = ("import sys, ipcount.cli as cli; cli.build_parser(); "
             "print(sorted(m for m in sys.modules if m.startswith('ipcount_lab')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_compose_spark_connect_is_what_the_airflow_tasks_point_at():
    services = _compose()["services"]
    server = services["spark-connect"]
    # In the scheduler's network: its tasks reach the server on localhost, where pyspark sends
    # the token without TLS.
    assert server["network_mode"] == "service:airflow-scheduler"
    command = server["command"][-1]
    serve = command.split("exec ", 1)[1].split()
    assert serve[:3] == ["ipcount", "connect-server", "--port"]
    flags = dict(zip(serve[2::2], serve[3::2]))
    # the token from .env, in the private file the server reads
    assert "umask 077" in command and f'> {flags["--token-file"]}' in command
    env = services["airflow-scheduler"]["environment"]
    assert env["AIRFLOW_CONN_IPCOUNT_CONNECT"] == \
        f"spark-connect://:{server['environment']['CONNECT_TOKEN']}@localhost:{flags['--port']}"
    # all parse the DAGs alike
    for name in ("airflow-scheduler", "airflow-dag-processor", "airflow-apiserver", "airflow-triggerer"):
        assert services[name]["environment"]["IPCOUNT_SPARK_CONNECT_CONNECTION"] == "ipcount_connect", name
    settings = {k[len("IPCOUNT_"):].lower(): v for k, v in env.items() if k.startswith("IPCOUNT_")}
    assert PipelineConfig.from_mapping(settings).spark_connect_connection == "ipcount_connect"  # valid, no stale one


def test_compose_holds_no_secret_and_publishes_ports_on_loopback_only():
    text = (REPO_ROOT / "docker-compose.yml").read_text()
    compose = _compose()
    env = {}
    for service in compose["services"].values():
        env.update(service.get("environment") or {})
    # Every secret is a reference to .env that fails when unset, never a value.
    for name in ("POSTGRES_PASSWORD", "AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW_ADMIN_PASSWORD",
                 "KAFKA_EXTERNAL_PASSWORD", "S3_SECRET", "AWS_SECRET_ACCESS_KEY", "CONNECT_TOKEN"):
        assert env[name].startswith("${IPCOUNT_") and ":?" in env[name], name
    assert ":${IPCOUNT_POSTGRES_PASSWORD:?" in env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
    assert ":${IPCOUNT_CONNECT_TOKEN:?" in env["AIRFLOW_CONN_IPCOUNT_CONNECT"]
    for leaked in ("change-me", '\\"admin\\": \\"admin', "airflow:airflow@", "PASSWORD: airflow"):
        assert leaked not in text, leaked
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)


def test_compose_env_makes_private_random_secrets_once(tmp_path):
    import os
    import re
    import subprocess

    env_file = tmp_path / ".env"
    run = lambda: subprocess.run([str(REPO_ROOT / "bin" / "compose-env"), str(env_file)],  # noqa: E731
                                 capture_output=True, text=True, check=True)
    run()
    first = env_file.read_text()
    assert os.stat(env_file).st_mode & 0o777 == 0o600
    values = dict(re.findall(r"^(IPCOUNT_[A-Z0-9_]+)=(\S+)$", first, re.M))
    compose = (REPO_ROOT / "docker-compose.yml").read_text()
    assert set(values) == set(re.findall(r"\$\{(IPCOUNT_[A-Z0-9_]+):\?", compose))  # exactly what compose needs
    assert all(len(v) >= 32 for v in values.values()) and len(set(values.values())) == len(values) == 6
    assert "0 secret(s) added" in run().stdout and env_file.read_text() == first  # never overwrites
    # A file from an older release gets what it lacks, and keeps the rest.
    env_file.write_text("".join(line + "\n" for line in first.splitlines() if "KAFKA_EXTERNAL" not in line))
    assert "1 secret(s) added" in run().stdout
    again = dict(re.findall(r"^(IPCOUNT_[A-Z0-9_]+)=(\S+)$", env_file.read_text(), re.M))
    assert set(again) == set(values) and all(again[k] == values[k] for k in values if "KAFKA_EXTERNAL" not in k)
    assert os.stat(env_file).st_mode & 0o777 == 0o600


def test_image_runs_as_a_user_of_its_own():
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    users = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0"), users
    compose = _compose()
    for name, service in compose["services"].items():
        # kafka-tls writes the broker's key as the Kafka image's user, who must read it.
        assert service.get("user") in (None, users[-1], "1000:1000"), name
    assert compose["services"]["kafka-tls"]["user"] == "1000:1000" and "chown 1000:1000 /run/kafka-tls" in dockerfile


def _kafka_properties(env: dict) -> dict:
    """The apache/kafka image's reading of KAFKA_* variables: "___" is "-", "__" is "_",
    "_" is "."."""
    return {k[len("KAFKA_"):].lower().replace("___", "-").replace("__", "\0").replace("_", ".").replace("\0", "_"): v
            for k, v in env.items() if k.startswith("KAFKA_")}


def test_compose_publishes_kafka_only_over_sasl_ssl_with_scram():
    services = _compose()["services"]
    props = _kafka_properties(services["kafka"]["environment"])
    protocols = dict(item.split(":") for item in props["listener.security.protocol.map"].split(","))
    published = {port.split(":")[2] for port in services["kafka"]["ports"]}
    listening = {entry.split("://")[0]: entry.rsplit(":", 1)[1] for entry in props["listeners"].split(",")}
    assert {name for name, port in listening.items() if port in published} == {"EXTERNAL"}
    assert protocols["EXTERNAL"] == "SASL_SSL"
    assert props["listener.name.external.sasl.enabled.mechanisms"] == "SCRAM-SHA-512,SCRAM-SHA-256"
    for mechanism in ("scram-sha-512", "scram-sha-256"):
        assert props[f"listener.name.external.{mechanism}.sasl.jaas.config"].startswith(
            "org.apache.kafka.common.security.scram.ScramLoginModule required")
    # The key store is the dev CA's broker certificate, for the names clients use.
    assert (props["ssl.keystore.type"], props["ssl.keystore.location"]) == ("PEM", "/run/kafka-tls/broker.pem")
    tls = services["kafka-tls"]["command"]
    hosts = {tls[i + 1] for i, arg in enumerate(tls) if arg == "--host"}
    advertised = {entry.split("://")[1].rsplit(":", 1)[0] for entry in props["advertised.listeners"].split(",")}
    assert advertised <= hosts and tls[:4] == ["python", "-m", "ipcount_lab.dev_tls", "/run/kafka-tls"]
    assert services["kafka"]["depends_on"]["kafka-tls"] == {"condition": "service_completed_successfully"}
    # kafka-init gives the external user its SCRAM credentials from .env, through a private file.
    init = services["kafka-init"]["command"][-1]
    assert "umask 077" in init and "ipcount scram-user --username ipcount --password-file" in init


def test_an_installed_wheel_finds_its_files_under_ipcount_home(tmp_path):
    """Installed from a wheel, the package is not in a checkout: IPCOUNT_HOME says where the jars,
    the epoch job and Kafka's tool are (the image sets it); the variable is no setting."""
    import subprocess
    import sys

    probe = ("from ipcount.rules.config import REPO_ROOT, STATE_DIR, PipelineConfig; "
             "from ipcount.orchestration.dags import EPOCH_APPLICATION; PipelineConfig.load(); "
             "print(REPO_ROOT, STATE_DIR, EPOCH_APPLICATION)")
    done = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "IPCOUNT_HOME": str(tmp_path)},
                          capture_output=True, text=True, check=True)
    assert done.stdout.split() == [str(tmp_path), str(tmp_path / ".local"), str(tmp_path / "spark_jobs/epoch_job.py")]


def test_bin_setup_installs_the_package_with_both_commands():
    """The editable install: the distribution's commands run this checkout's code."""
    from importlib.metadata import distribution

    dist = distribution("ipcount")
    commands = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert commands == {"ipcount": "ipcount.cli:main", "ipcount-lab": "ipcount_lab.cli:main"}
    import ipcount
    assert Path(ipcount.__file__).resolve().parent == REPO_ROOT / "ipcount"
