"""The cockpit: a live web page of training runs, served from a run folder's files.

`tracerl dashboard --runs runs` serves it (FastAPI, loopback only). It reads what runs
write — metrics.jsonl, the traces.db store (read-only SQL, `queries`), the control files —
and sends live control commands through the run dir's control.jsonl
(tracerl.pipeline.control_files). `app` holds the HTTP API, `static/` the page.
"""
