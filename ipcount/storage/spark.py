"""The Spark session an epoch runs in, and the settings spark-submit needs for the same."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ipcount.rules.config import STATE_DIR, PipelineConfig
from ipcount.rules.errors import MissingJarsError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

# Resolved once from Maven Central by bin/setup (see jars/spark-extras.xml).
SPARK_JARS_DIR = STATE_DIR / "jars" / "spark"
# A spark-submitted driver must run this interpreter: the one with the pinned pyspark and
# this package (the DAGs' operator and the benchmark pass it to spark-submit).
DRIVER_ENV = {"PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}


# Java options of the driver and the executors (see spark_conf).
JVM_OPTIONS = "-Xss4m -XX:-DontCompileHugeMethods"


def spark_jars(jars_dir: Path = SPARK_JARS_DIR) -> list[str]:
    """The Kafka connector and Delta jars, which pyspark's own jars do not include."""
    jars = sorted(str(p) for p in jars_dir.glob("*.jar"))
    needed = ("spark-sql-kafka", "delta-spark", "kafka-clients")
    missing = [n for n in needed if not any(Path(j).name.startswith(n) for j in jars)]
    if missing:
        raise MissingJarsError(
            f"no {', '.join(missing)} jar in {jars_dir}; run bin/setup to fetch them from Maven Central")
    return jars


def spark_conf(cfg: PipelineConfig) -> dict[str, str]:
    """Spark settings shared by the in-process session and spark-submit (the DAG's path)."""
    return {
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        "spark.sql.session.timeZone": "UTC",
        # Epochs are small batches on few cores: a handful of shuffle partitions, not 200.
        "spark.sql.shuffle.partitions": "4",
        "spark.databricks.delta.snapshotPartitions": "2",
        "spark.ui.showConsoleProgress": "false",
        # Only path-based Delta tables are used; keep Spark's catalog directory out of the cwd.
        "spark.sql.warehouse.dir": str(STATE_DIR / "spark-warehouse"),
        # Spark recurses once per nesting level of a JSON value (parse_json, schema_of_variant):
        # 4 MB thread stacks leave room for the deepest record Jackson accepts, where 1 MB
        # overflowed in a cold JVM, and a StackOverflowError kills the executor. (These
        # replace any extraJavaOptions of spark-defaults.conf: add these to your own.)
        # The parse's generated code has a method over HotSpot's 8,000-byte limit for JIT
        # compilation; without -XX:-DontCompileHugeMethods it runs interpreted, far slower
        # (docs/performance.md).
        "spark.driver.extraJavaOptions": f"-Dlog4j2.level=warn {JVM_OPTIONS}",
        "spark.executor.extraJavaOptions": JVM_OPTIONS,
    }


def get_spark(cfg: PipelineConfig, app_name: str = "ipcount-epoch") -> SparkSession:
    """A session with Delta and the Kafka source.

    Under spark-submit (the DAG's path) the JVM is already running with the master, jars
    and settings that were submitted, so they are used as they are.
    """
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    if "PYSPARK_GATEWAY_PORT" not in os.environ:  # not launched by spark-submit
        builder = builder.master(cfg.spark_master).config("spark.jars", ",".join(spark_jars()))
        for key, value in spark_conf(cfg).items():
            builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark
