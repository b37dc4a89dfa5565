"""numbactr.log: info_once says a thing once; progress is silent for short tasks off a terminal, writes
periodic lines and a closing line for long ones, and can be turned off."""

from numbactr import log


def test_info_once(capsys):
    log.info_once(("test", 1), "first")
    log.info_once(("test", 1), "again")
    log.info_once(("test", 2), "other")
    out = capsys.readouterr().out
    assert out.count("first") == 1 and "again" not in out and "other" in out


def test_progress_off_a_terminal(capsys, monkeypatch):
    monkeypatch.delenv("NUMBACTR_PROGRESS", raising=False)
    monkeypatch.setenv("NUMBACTR_PROGRESS_INTERVAL", "3600")
    with log.progress(total=10, desc="short", unit="sample") as bar:
        bar.update(10)
    assert capsys.readouterr().out == ""  # short task: nothing at all
    monkeypatch.setenv("NUMBACTR_PROGRESS_INTERVAL", "0")
    with log.progress(total=4, desc="long", unit="sample") as bar:
        bar.update(1)
        bar.update(3)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all("[INFO]" in ln and "long: " in ln for ln in lines)
    assert "1/4 sample (25%)" in lines[0] and "4/4 sample (100%)" in lines[1] and lines[2].endswith(", done")


def test_progress_can_be_turned_off(capsys, monkeypatch):
    monkeypatch.setenv("NUMBACTR_PROGRESS", "0")
    monkeypatch.setenv("NUMBACTR_PROGRESS_INTERVAL", "0")
    with log.progress(total=2, desc="x") as bar:
        bar.update(2)
    assert capsys.readouterr().out == ""
