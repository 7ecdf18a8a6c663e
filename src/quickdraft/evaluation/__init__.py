"""Evaluation: benchmark data, code extraction and execution, statistics, the harness, reports.

``datasets``, ``extract``, ``sandbox``, ``quality``
    benchmark data, code extraction, sandboxed execution, statistics
``bench``, ``report``, ``anchors``
    the benchmark harness (``quickdraft bench``), its reports, the tools compared against
``analyze``
    the theory toolkit's study on the real models (``quickdraft analyze``)
"""
