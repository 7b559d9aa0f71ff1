"""The wire, declared once (what crosses a stage boundary): so far the domain errors and their envelope
(``errors``). No Triton import."""
