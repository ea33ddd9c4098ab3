# A device (gateway) image: edgeps[device] and a TFLite runtime only; no TensorFlow, no
# scikit-learn, no matplotlib (tests/test_packaging.py checks the device modules need none).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY ps_service ps_service
COPY edge_client edge_client
COPY learning learning
COPY broker broker
COPY edgeps edgeps
RUN pip install --no-cache-dir ".[device,tflite]"
ENTRYPOINT ["edgeps", "client"]
