"""The GPU benchmark suites that ``longtrain bench`` runs, shipped with the package.

One module per suite (``blockdiag_attention``, ``dsa``, ``prewarm``; the table is ``longtrain.bench.SUITES``), each
runnable as ``python -m longtrain.bench_suites.<module>``; ``report`` is the report writer every benchmark shares
and ``anchors.json`` the reference figures drawn next to our rows. A source checkout's ``benchmarks/<module>.py``
are thin entry points to these modules; the other scripts of that folder (probes, CP scaling, exit checks) are not
part of the wheel.
"""
