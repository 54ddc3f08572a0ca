"""Bad input raises a clear ValueError/TypeError naming the argument, before any launch."""
import math

import numpy as np
import pytest

import numba_flash

Q = np.zeros((2, 8, 4), np.float32)
Q4 = np.zeros((2, 3, 8, 4), np.float32)


pytestmark = pytest.mark.usefixtures("no_launch")   # conftest: any kernel launch fails these tests


CASES = [
    # (description, args, kwargs, exception, words the message must contain)
    ("q is no array", (object(), Q, Q), {}, TypeError, "q must be"),
    ("q is a list of another shape", ([[1.0]], Q, Q), {}, ValueError, "head dim"),
    ("k is a scalar", (Q, 1.0, Q), {}, ValueError, "k must have at least 2"),
    ("v has one dim", (Q, Q, np.zeros(4, np.float32)), {}, ValueError, "v must have at least 2"),
    ("q is empty", (np.zeros((0, 4), np.float32), Q[0], Q[0]), {}, ValueError, "q has an empty"),
    ("k has empty head dim", (Q, np.zeros((2, 8, 0), np.float32), Q), {}, ValueError, "k has an empty"),
    ("float64", (Q.astype(np.float64),) * 3, {}, TypeError, "dtype float64"),
    ("int", (Q.astype(np.int32),) * 3, {}, TypeError, "dtype int32"),
    ("mixed dtypes", (Q, Q, Q.astype(np.float16)), {"algorithm": "flash2"}, TypeError, "share one dtype"),
    ("float16 for flash1", (Q.astype(np.float16),) * 3, {"algorithm": "flash1"}, TypeError, "flash2"),
    ("leading dims differ", (Q4, Q4[:1], Q4[:1]), {}, ValueError, "leading"),
    ("query heads not a multiple of key/value heads", (Q4, Q4[:, :2], Q4[:, :2]), {"algorithm": "flash2"},
     ValueError, "multiple of the key/value heads"),
    ("grouped-query heads for flash1", (Q4, Q4[:, :1], Q4[:, :1]), {}, ValueError, "flash2"),
    ("N_k of k and v differ", (Q, Q, Q[:, :5]), {}, ValueError, "N_k"),
    ("head dims differ", (Q, Q[..., :3], Q[..., :3]), {}, ValueError, "head dim"),
    ("v head dim differs", (Q, Q, Q[..., :3]), {}, ValueError, "head dim"),
    ("unknown algorithm", (Q, Q, Q), {"algorithm": "flash3"}, ValueError, "algorithm"),
    ("nan scale", (Q, Q, Q), {"scale": math.nan}, ValueError, "scale"),
    ("inf scale", (Q, Q, Q), {"scale": math.inf}, ValueError, "scale"),
    ("string scale", (Q, Q, Q), {"scale": "0.5"}, TypeError, "scale"),
    ("causal not bool", (Q, Q, Q), {"causal": 1}, TypeError, "causal"),
    ("causal alignment unknown", (Q, Q, Q), {"causal": "diagonal"}, ValueError, "bottom_right"),
    ("block size zero", (Q, Q, Q), {"algorithm": "flash1", "block_sizes": (0, 4)}, ValueError, "block_sizes"),
    ("block size negative", (Q, Q, Q), {"algorithm": "flash1", "block_sizes": (4, -1)}, ValueError, "block_sizes"),
    ("block sizes not a pair", (Q, Q, Q), {"algorithm": "flash1", "block_sizes": (4,)}, TypeError, "block_sizes"),
    ("block sizes float", (Q, Q, Q), {"algorithm": "flash1", "block_sizes": (4.0, 4)}, TypeError, "block_sizes"),
    ("block sizes too big for shared memory", (Q, Q, Q), {"algorithm": "flash1", "block_sizes": (64, 2048)},
     ValueError, "shared memory"),
    ("block rows beyond threads per block", (Q, Q, Q), {"algorithm": "flash1", "block_sizes": (2048, 1)},
     ValueError, "threads per block"),
    ("block sizes for standard", (Q, Q, Q), {"algorithm": "standard", "block_sizes": (4, 4)}, ValueError,
     "block_sizes"),
    ("flash2 rows not a multiple of 16", (Q, Q, Q), {"algorithm": "flash2", "block_sizes": (24, 16)},
     ValueError, "multiple of 16"),
    ("flash2 columns not a multiple of 8", (Q, Q, Q), {"algorithm": "flash2", "block_sizes": (16, 12)},
     ValueError, "multiple of 8"),
    ("flash2 float16 columns not a multiple of 16", (Q.astype(np.float16),) * 3,
     {"algorithm": "flash2", "block_sizes": (16, 8)}, ValueError, "multiple of 16"),
    ("flash2 too many threads", (Q, Q, Q), {"algorithm": "flash2", "block_sizes": (1024, 16)}, ValueError,
     "threads per block"),
    ("flash2 tiles beyond shared memory", (Q, Q, Q), {"algorithm": "flash2", "block_sizes": (128, 1024)},
     ValueError, "shared memory"),
    ("flash2 head dim too large", (np.zeros((8, 300), np.float32),) * 3, {"algorithm": "flash2"},
     ValueError, "head dim"),
    ("dropout out of range", (Q, Q, Q), {"dropout_p": 1.0}, ValueError, "dropout_p"),
    ("dropout not a number", (Q, Q, Q), {"dropout_p": "0.1"}, TypeError, "dropout_p"),
    ("seed not an int", (Q, Q, Q), {"seed": 1.5}, TypeError, "seed"),
]


@pytest.mark.parametrize("description, args, kwargs, error, words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_rejected_with_a_clear_message(description, args, kwargs, error, words):
    kwargs.setdefault("algorithm", "flash1")
    with pytest.raises(error, match=words):
        numba_flash.attention(*args, **kwargs)


def test_mixing_host_and_device_arrays_is_rejected():
    from numba import cuda
    with pytest.raises(TypeError, match="all be host arrays .* or all CUDA arrays"):
        numba_flash.attention(Q, cuda.to_device(Q), Q, algorithm="flash1")


@pytest.mark.parametrize("seed", [-1, 2 ** 64])
def test_seed_outside_64_bits_is_rejected(seed):
    with pytest.raises(ValueError, match="seed"):
        numba_flash.attention(Q, Q, Q, algorithm="flash1", dropout_p=0.1, seed=seed)
