# Two images from one file (and a stage that builds the parse jar), with the same pinned Python packages and jars as bin/setup, so
# versions always agree:
#   product  what a deployment runs: Airflow (api-server, scheduler, dag-processor) with the
#            DAGs and plugin, the Spark master, workers and Connect server, the Kafka set-up
#            (create-topic, scram-user) and Kafka's consumer-groups tool. No lab code.
#   lab      the product plus the lab (ipcount_lab, bin/lab, s3proxy): docker-compose.yml's
#            stand-ins for infrastructure you would have (dev CA, object store, traffic).
# The record parse's jar (jars/ipcount-parse), built where a JDK is; the images need a JRE only.
FROM python:3.11-slim-bookworm AS parse-jar
RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jdk-headless maven \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/ipcount
COPY jars ./jars
RUN mvn -s jars/maven-settings.xml -B -q -f jars/ipcount-parse/pom.xml -Dmaven.test.skip=true package

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
# The Spark jars (Kafka source, Delta) and Kafka's, for bin/kafka-consumer-groups.
RUN for pom in kafka-broker:kafka spark-extras:spark; do \
      mvn -s jars/maven-settings.xml -B -q -f "jars/${pom%%:*}.xml" dependency:copy-dependencies \
        -DoutputDirectory="/opt/ipcount/.local/jars/${pom##*:}" -DincludeScope=runtime; \
    done && rm -rf /root/.m2
COPY --from=parse-jar /opt/ipcount/.local/build/ipcount-parse/ipcount-parse.jar ./.local/jars/ipcount/
COPY ipcount ./ipcount
COPY dags ./dags
COPY plugins ./plugins
COPY spark_jobs/epoch_job.py ./spark_jobs/
COPY bin/kafka-consumer-groups ./bin/
RUN echo /opt/ipcount > "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/ipcount-repo.pth"
ENV SPARK_HOME=/usr/local/lib/python3.11/site-packages/pyspark \
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
COPY ipcount_lab ./ipcount_lab
COPY bin/lab ./bin/
RUN mkdir -p /data/s3 /run/kafka-tls \
 && chown ipcount:ipcount /data/s3 \
 && chown 1000:1000 /run/kafka-tls && chmod 700 /run/kafka-tls  # the Kafka image's appuser
USER 10001
