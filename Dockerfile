# One image for every service of docker-compose.yml: Airflow (api-server, scheduler,
# dag-processor), the Spark master and worker, and the traffic generator. The same pinned
# Python packages and jars as the embedded stack (bin/setup), so versions always agree.
FROM python:3.11-slim-bookworm

RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless maven curl procps \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/ipcount
COPY requirements.txt constraints.txt ./
RUN pip install --no-cache-dir -r requirements.txt -c constraints.txt
COPY jars ./jars
RUN for pom in kafka-broker:kafka spark-extras:spark s3proxy:s3proxy; do \
      mvn -s jars/maven-settings.xml -B -q -f "jars/${pom%%:*}.xml" dependency:copy-dependencies \
        -DoutputDirectory="/opt/ipcount/.local/jars/${pom##*:}" -DincludeScope=runtime; \
    done && rm -rf /root/.m2
COPY . .
RUN echo /opt/ipcount > "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/ipcount-repo.pth"
ENV SPARK_HOME=/usr/local/lib/python3.11/site-packages/pyspark \
    PYSPARK_PYTHON=python3
# Every service runs as this user, not root. The directories the compose volumes mount are
# made (and owned) here, so fresh named volumes take this owner.
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin ipcount \
 && mkdir -p /data/s3 /opt/airflow /run/kafka-tls \
 && chown ipcount:ipcount /data/s3 /opt/airflow \
 && chown 1000:1000 /run/kafka-tls && chmod 700 /run/kafka-tls  # the Kafka image's appuser
USER 10001
