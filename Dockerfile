# Two images from one file (and a stage that builds the parse jar), with the same pinned Python packages and jars as bin/setup, so
# versions always agree:
#   product  what a deployment runs: Airflow (api-server, scheduler, dag-processor) with the
#            DAGs and plugin, the Spark master, workers and Connect server, the Kafka set-up
#            (create-topic, scram-user) and Kafka's consumer-groups tool. No lab code.
#   lab      the product plus the lab (ipcount_lab, the ipcount-lab command, s3proxy):
#            docker-compose.yml's stand-ins for infrastructure you would have (dev CA, object
#            store, traffic).
# Each installs the package as a wheel (setup.py: IPCOUNT_DIST=product builds the product alone).
# The record parse's jar (jars/ipcount-parse), built where a JDK is; the images need a JRE only.
FROM python:3.11-slim-bookworm AS parse-jar
RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jdk-headless maven \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/ipcount
COPY jars ./jars
RUN mvn -s jars/maven-settings.xml -B -q -f jars/ipcount-parse/pom.xml -Dmaven.test.skip=true package

# The package's two wheels: the product alone, and the product with the lab.
FROM python:3.11-slim-bookworm AS wheels
WORKDIR /src
COPY pyproject.toml setup.py README.md requirements.txt requirements-lab.txt ./
COPY ipcount ./ipcount
COPY ipcount_lab ./ipcount_lab
RUN IPCOUNT_DIST=product pip wheel --no-cache-dir --no-deps -w /wheels/product . \
 && pip wheel --no-cache-dir --no-deps -w /wheels/dev .

FROM python:3.11-slim-bookworm AS product

RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless maven curl procps \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/ipcount
COPY requirements.txt requirements-lineage.txt constraints.txt ./
# --build-arg WITH_OPENLINEAGE=true adds the optional OpenLineage provider (bin/setup --lineage).
ARG WITH_OPENLINEAGE=false
RUN pip install --no-cache-dir -r requirements.txt -c constraints.txt \
 && if [ "$WITH_OPENLINEAGE" = true ]; then \
      pip install --no-cache-dir -r requirements-lineage.txt -c constraints.txt; fi
COPY jars ./jars
# The Spark jars (the Kafka source) and Kafka's, for bin/kafka-consumer-groups.
RUN for pom in kafka-broker:kafka spark-extras:spark; do \
      mvn -s jars/maven-settings.xml -B -q -f "jars/${pom%%:*}.xml" dependency:copy-dependencies \
        -DoutputDirectory="/opt/ipcount/.local/jars/${pom##*:}" -DincludeScope=runtime; \
    done && rm -rf /root/.m2
COPY --from=parse-jar /opt/ipcount/.local/build/ipcount-parse/ipcount-parse.jar ./.local/jars/ipcount/
COPY --from=wheels /wheels/product /tmp/wheels
RUN pip install --no-cache-dir --no-deps /tmp/wheels/*.whl && rm -rf /tmp/wheels
# What the installed package runs from IPCOUNT_HOME: the DAGs, the plugin, the Spark job, Kafka's tool.
COPY dags ./dags
COPY plugins ./plugins
COPY spark_jobs/epoch_job.py ./spark_jobs/
COPY bin/kafka-consumer-groups ./bin/
ENV IPCOUNT_HOME=/opt/ipcount \
    SPARK_HOME=/usr/local/lib/python3.11/site-packages/pyspark \
    PYSPARK_PYTHON=python3
# Every service runs as this user, not root. The directories the compose volumes mount are
# made (and owned) here, so fresh named volumes take this owner.
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin ipcount \
 && mkdir -p /opt/airflow && chown ipcount:ipcount /opt/airflow
USER 10001

FROM product AS lab
USER root
RUN mvn -s jars/maven-settings.xml -B -q -f jars/s3proxy.xml dependency:copy-dependencies \
      -DoutputDirectory=/opt/ipcount/.local/jars/s3proxy -DincludeScope=runtime \
 && rm -rf /root/.m2
COPY requirements-lab.txt ./
COPY --from=wheels /wheels/dev /tmp/wheels
RUN pip install --no-cache-dir -r requirements-lab.txt -c constraints.txt \
 && pip install --no-cache-dir --no-deps --force-reinstall /tmp/wheels/*.whl && rm -rf /tmp/wheels
RUN mkdir -p /data/s3 /run/kafka-tls \
 && chown ipcount:ipcount /data/s3 \
 && chown 1000:1000 /run/kafka-tls && chmod 700 /run/kafka-tls  # the Kafka image's appuser
USER 10001
