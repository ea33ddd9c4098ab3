"""A Keras model as the built-in model: the same function, and a named refusal of what does not convert."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tensorflow", reason="the tf extra has Keras")

import keras

from learning.keras import KerasError, from_keras, layer_names, save_keras
from learning.model import forward

L = keras.layers


def cnn() -> keras.Model:
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            L.Conv2D(6, 3, activation="relu"),
            L.Flatten(),
            L.Dense(16),
            L.ReLU(),
            L.Dropout(0.3),
            L.Dense(10, activation="softmax"),
        ]
    )


def test_a_converted_model_computes_what_keras_computes() -> None:
    model = cnn()
    params = from_keras(model, "cross_entropy")
    assert {k: v.shape for k, v in params.items()} == {
        "conv0.w": (9, 6),
        "conv0.b": (6,),
        "dense0.w": (216, 16),
        "dense0.b": (16,),
        "dense1.w": (16, 10),
        "dense1.b": (10,),
    }
    x = np.random.default_rng(0).random((7, 64), dtype=np.float32)
    z = forward(params, x)
    softmax = np.exp(z - z.max(axis=1, keepdims=True))
    softmax /= softmax.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(model.predict(x.reshape(7, 8, 8, 1), verbose=0), softmax, atol=1e-6)
    assert layer_names(model, "cross_entropy")["conv0.w"] == model.layers[0].name
    regression = keras.Sequential([keras.Input((5,)), L.Dense(8, activation="relu"), L.Dense(1)])
    x5 = x[:, :5]
    np.testing.assert_allclose(regression.predict(x5, verbose=0), forward(from_keras(regression, "mse"), x5), atol=1e-6)


def test_a_keras_conv1d_on_sensor_windows_converts() -> None:
    keras.utils.set_random_seed(2)
    model = keras.Sequential(
        [
            keras.Input((25, 3)),
            L.Conv1D(8, 5, activation="relu"),
            L.Flatten(),
            L.Dense(16, activation="relu"),
            L.Dense(6, activation="softmax"),
        ]
    )
    params = from_keras(model, "cross_entropy")
    assert params["tconv0.w"].shape == (5, 3, 8) and params["dense0.w"].shape == (21 * 8, 16)
    x = np.random.default_rng(0).normal(size=(7, 75)).astype(np.float32)  # windows flattened time-major
    z = forward(params, x)
    softmax = np.exp(z - z.max(axis=1, keepdims=True))
    softmax /= softmax.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(model.predict(x.reshape(7, 25, 3), verbose=0), softmax, atol=1e-5)


def test_a_pooled_keras_conv1d_converts_and_computes_what_keras_computes() -> None:
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((25, 3)),
            L.Conv1D(8, 5, activation="relu"),
            L.MaxPooling1D(3),
            L.Flatten(),
            L.Dense(6, activation="softmax"),
        ]
    )
    params = from_keras(model, "cross_entropy")
    assert params["dense0.w"].shape == (7 * 8, 6)  # 21 positions pooled by 3
    x = np.random.default_rng(1).normal(size=(5, 75)).astype(np.float32)
    z = forward(params, x)
    softmax = np.exp(z - z.max(axis=1, keepdims=True))
    softmax /= softmax.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(model.predict(x.reshape(5, 25, 3), verbose=0), softmax, atol=1e-5)


def test_trained_parameters_go_back_into_keras_and_tflite(tmp_path) -> None:
    model = cnn()
    params = {k: v + 0.01 for k, v in from_keras(model, "cross_entropy").items()}
    keras_path, tflite_path = save_keras(model, params, tmp_path / "model", "cross_entropy")
    loaded = keras.models.load_model(keras_path)
    x = np.random.default_rng(1).random((3, 64), dtype=np.float32)
    z = forward(params, x)
    expected = np.exp(z - z.max(axis=1, keepdims=True))
    expected /= expected.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(loaded.predict(x.reshape(3, 8, 8, 1), verbose=0), expected, atol=1e-6)
    assert tflite_path.read_bytes()[4:8] == b"TFL3"


def test_a_binary_model_with_its_sigmoid_head_is_saved_too(tmp_path) -> None:
    model = keras.Sequential([keras.Input((4,)), L.Dense(8, activation="relu"), L.Dense(1, activation="sigmoid")])
    params = from_keras(model, "bce")
    keras_path, _ = save_keras(model, params, tmp_path / "binary", "bce")
    x = np.random.default_rng(2).random((5, 4), dtype=np.float32)
    expected = 1 / (1 + np.exp(-forward(params, x)))
    np.testing.assert_allclose(keras.models.load_model(keras_path).predict(x, verbose=0), expected, atol=1e-6)


@pytest.mark.parametrize(
    ("layers", "shape", "message"),
    [
        (
            [L.Conv2D(4, 3, activation="relu"), L.MaxPooling2D(), L.Flatten(), L.Dense(10)],
            (8, 8, 1),
            r"layer 'max_pooling2d\w*' \(MaxPooling2D\) does not convert",
        ),
        ([L.BatchNormalization(), L.Dense(10)], (64,), r"\(BatchNormalization\) does not convert"),
        ([L.DepthwiseConv2D(3), L.Flatten(), L.Dense(10)], (8, 8, 1), r"\(DepthwiseConv2D\) does not convert"),
        ([L.Reshape((8, 8)), L.LSTM(4), L.Dense(10)], (64,), r"\(Reshape\): only a first Reshape"),
        ([L.Dense(16, activation="tanh"), L.Dense(10)], (64,), r"activation 'tanh' on a hidden layer"),
        (
            [L.Dense(16, activation="relu"), L.Dense(10, activation="sigmoid")],
            (64,),
            r"activation 'sigmoid' on the output does not fit loss 'cross_entropy' \(use linear or softmax\)",
        ),
        ([L.Conv2D(4, 3, strides=2, activation="relu"), L.Flatten(), L.Dense(10)], (8, 8, 1), r"strides 1"),
        ([L.Conv2D(4, 3, activation="relu"), L.Dense(10)], (8, 8, 1), r"needs a Flatten before it"),
        ([L.Dense(16, use_bias=False, activation="relu"), L.Dense(10)], (64,), r"needs use_bias=True"),
        (
            [L.Conv1D(4, 3, activation="relu"), L.MaxPooling1D(2), L.Flatten(), L.Dense(6)],
            (25, 3),
            r"\(MaxPooling1D\): needs strides equal to its pool size, padding 'valid', and a pool size that divides "
            r"the Conv1D's 23 positions",
        ),
        (
            [L.Dense(8, activation="relu"), L.Reshape((8, 1)), L.MaxPooling1D(2), L.Flatten(), L.Dense(6)],
            (64,),
            r"Reshape",
        ),
        ([L.Conv1D(4, 3, padding="same", activation="relu"), L.Flatten(), L.Dense(6)], (25, 3), r"padding 'valid'"),
    ],
)
def test_what_does_not_convert_is_refused_naming_the_layer(layers, shape, message) -> None:
    model = keras.Sequential([keras.Input(shape), *layers])
    with pytest.raises(KerasError, match=message):
        from_keras(model, "cross_entropy")
