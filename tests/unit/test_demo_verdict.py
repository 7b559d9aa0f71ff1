from clients.demo import verdict
from clients.triton_client import GenerateResult


def test_the_verdict_says_yes_only_for_the_same_tokens(capsys):
    llm = GenerateResult(text="ab cd", num_output_tokens=3)
    assert verdict({"llm": llm, "epd": GenerateResult(text="ab cd", num_output_tokens=3)})
    assert "llm and epd gave the same 3 tokens: yes" in capsys.readouterr().out
    assert not verdict({"llm": llm, "epd": GenerateResult(text="ab ce", num_output_tokens=3)})
    assert "llm and epd gave the same 3 tokens: NO" in capsys.readouterr().out
    assert not verdict({"llm": llm, "epd": GenerateResult(text="ab cd", num_output_tokens=4)})
