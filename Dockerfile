# One image for the broker, the parameter server and demo devices.
# (A slimmer device-only image without scikit-learn and matplotlib is future work.)
FROM python:3.11-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends mosquitto \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY ps_service ps_service
COPY edge_client edge_client
COPY learning learning
COPY broker broker
COPY edgeps edgeps
RUN pip install --no-cache-dir ".[server]"
ENTRYPOINT ["edgeps"]
