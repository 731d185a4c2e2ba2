"""``flexgroup doctor``: versions, and each built-in architecture patched and checked here (the zoo's text
models and the vision-language Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5).

The check is the repeated baseline (each sequence alone through an unpatched copy); the broken variants
(plain causal attention over the packed row; a hybrid fork that leaks) must turn the report's lines
into WRONG / refused and the exit status into 1.
"""

from __future__ import annotations

import pytest

from flexgroup import cli
from flexgroup.bench import doctor
from flexgroup.models import zoo


def _report(capsys) -> tuple[int, dict[str, str], str]:
    rc = cli.main(["doctor"])
    out = capsys.readouterr().out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.split() and ln.split()[0] in doctor.architectures()}
    return rc, lines, out


def test_doctor_lists_versions_and_every_declared_architecture_ok(capsys):
    from importlib.metadata import version

    rc, lines, out = _report(capsys)
    assert f"torch         {version('torch')}" in out and f"transformers  {version('transformers')}" in out
    assert set(lines) == set(zoo.ARCHS) | {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"}
    for arch, line in lines.items():
        expected = "not declared here" if zoo.unavailable(arch) else "ok"
        assert line.split(maxsplit=1)[1].startswith(expected), line
    assert rc == 0 and "all declared ones supported" in out


def test_doctor_reports_a_wrong_result_and_exits_one(capsys, causal_over_packed_row):
    """Broken variant: plain causal attention over the packed row in place of flexgroup's."""
    rc, lines, out = _report(capsys)
    assert rc == 1 and "WRONG" in lines["llama"] and "please report this output" in out
    for arch in zoo.VL_ARCHS:
        assert ("not declared here" if zoo.unavailable(arch) else "WRONG") in lines[arch], lines[arch]


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_doctor_checks_a_vision_language_model_on_its_image(arch, monkeypatch):
    """The image reaches both sides: the grouped forward runs the vision tower, the stock copy gets each sequence's
    own pixels. Broken variant: the copy sees other pixels (doubled), and the check says WRONG."""
    from flexgroup.data.multimodal import MultimodalGroupedBatch

    if why := zoo.unavailable(arch):
        pytest.skip(why)
    status, detail = doctor.check_arch(arch)
    assert status == "ok", detail
    real = MultimodalGroupedBatch.sequence_inputs

    def other_pixels(self, i, device=None):
        out = real(self, i, device)
        return dict(out, pixel_values=2 * out["pixel_values"])

    monkeypatch.setattr(MultimodalGroupedBatch, "sequence_inputs", other_pixels)
    status, detail = doctor.check_arch(arch)
    assert status == "WRONG" and "differ from each sequence alone" in detail, detail


def test_doctor_reports_a_refused_hybrid_with_patchs_message(capsys, monkeypatch):
    """Broken variant: a hybrid fork that leaks state; ``patch``'s probe refuses and doctor says so."""
    from flexgroup.patches.hybrid import attrs as hybrid_attrs
    from flexgroup.patches.hybrid import wrappers as hybrid_wrappers

    if why := zoo.unavailable("qwen3_5_text"):
        pytest.skip(why)

    def leaking_conv(original, plan, x, weight, bias=None, activation=None, conv_input=None, **kwargs):
        return original(x, weight, bias, activation=activation, **kwargs)

    monkeypatch.setattr(hybrid_wrappers, "forked_conv", leaking_conv)
    monkeypatch.setattr(hybrid_attrs, "forked_conv", leaking_conv)
    status, detail = doctor.check_arch("qwen3_5_text")
    assert status == "refused" and "differs from each sequence run alone" in detail


def test_verify_names_an_architecture_below_its_declared_transformers_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(zoo, "unavailable", lambda arch: f"flexgroup forks {arch} on transformers 9.0 and later")
    assert cli.main(["verify", "--arch", "bamba"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--arch bamba: flexgroup forks bamba on transformers 9.0" in err[0]
