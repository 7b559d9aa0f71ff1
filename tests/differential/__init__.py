"""The differential harness (issue 35): seeded request mixes per family topology, sent concurrently through ``llm``,
``epd`` and ``epd_disagg`` over Triton's gRPC and the OpenAI endpoint; every valid case must give ``llm``'s tokens,
every invalid one INVALID_ARG (400) naming the field.

    python -m tests.differential --family qwen3_vl --cases 2000 --seed 7       # a soak: its own server, stopped after
    python -m tests.differential --family qwen3_vl --seed 7 --only 12          # replay one case
    python -m tests.differential --family qwen2_audio --cases 20 --show        # the cases' shapes, no server

``cases`` (the generator), ``invalid`` (the invalid kinds), ``media`` (building items from specs), ``requests`` (a
case as gRPC and OpenAI requests, the field a refusal must name), ``clients`` (sending one), ``runner`` (concurrency
and comparison), ``servers`` (the CLI's tritonserver); the bounded runs in ``make test``:
``tests/e2e/test_differential.py`` and the family modules' ``test_differential_*``.
"""
