# The parameter server (and the data preparation): scikit-learn for the digits, matplotlib for
# plots; add the tf extra to build devices' TFLite trainers:  --build-arg EXTRAS=server,tf
FROM python:3.11-slim
ARG EXTRAS=server
WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY ps_service ps_service
COPY edge_client edge_client
COPY learning learning
COPY broker broker
COPY edgeps edgeps
# gcc builds the optional compiled codec loops, then goes
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && pip install --no-cache-dir ".[${EXTRAS}]" \
 && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*
ENTRYPOINT ["edgeps"]
