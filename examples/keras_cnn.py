"""A Keras CNN on image data: the 8x8 digits as (8, 8, 1) images, a 3x3 convolution with 8
filters, a dense layer of 32, dropout, and a softmax over the 10 classes.

    edgeps demo --task examples/keras_cnn.py

The server builds the Keras model (TensorFlow is needed there only: the function below is called
by the server, never by a device), converts its layers to the built-in CNN that every device runs,
starts the job from its initial weights, and at the end writes the trained model back into it:
``OUT/model.keras`` and ``OUT/model.tflite`` beside ``OUT/model.npz``.
"""

from typing import Any

import numpy as np

from edgeps import Task


def model() -> Any:
    import keras

    keras.utils.set_random_seed(0)  # the same version 0 on every run
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dropout(0.1),  # accepted; devices train without it (docs/TASKS.md)
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


def images() -> tuple[np.ndarray, np.ndarray]:
    """(n, 8, 8, 1) images in [0, 1] and their digits; the task flattens images row by row."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return (bunch.images / 16.0).astype(np.float32)[..., None], bunch.target


task = Task(name="keras-cnn", model=model, loss="cross_entropy", metrics=("accuracy", "macro_f1"), data=images)
