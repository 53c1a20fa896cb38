"""Progress as people see it: the local launcher echoes a `\r`-redrawn bar from a stage (lm-eval's,
datasets') as its last drawing, once, instead of blank `[stage]` lines and every redraw."""

from __future__ import annotations

import io
import os
import threading

from lmforge.launch.local import LocalLauncher


def test_a_redrawn_bar_is_echoed_once_as_its_last_drawing(tmp_path):
    written = (
        "\rGenerating test split: 0 examples\rGenerating test split: 24 examples\n"
        "\r  0%|          | 0/24\r 79%|#######9  | 19/24\r100%|##########| 24/24\n"
        "\r          \r\n"  # a bar that cleared itself (leave=False): nothing to keep
        "loglikelihood: 11/11 requests (100%), 0:01 elapsed\r\n"
        "token hf_secret_value\n"
    )
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "wb") as pipe:
        pipe.write(written.encode())
    stream, log = io.StringIO(), io.StringIO()
    launcher = LocalLauncher(stream=stream)
    pump = threading.Thread(
        target=launcher._pump,
        args=(os.fdopen(read_end, "rb"), log, "eval", {"HF_TOKEN": "hf_secret_value"}),
    )
    pump.start()
    pump.join(timeout=10)
    assert stream.getvalue().splitlines() == [
        "[eval] Generating test split: 24 examples",
        "[eval] 100%|##########| 24/24",
        "[eval] loglikelihood: 11/11 requests (100%), 0:01 elapsed",
        "[eval] token ***",
    ]
    assert log.getvalue() == "".join(
        line[len("[eval] ") :] + "\n" for line in stream.getvalue().splitlines()
    )
