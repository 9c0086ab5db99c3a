"""`prepare` renders the embedded plays as plain speaker-turn text (`ROMEO:` then the lines); --markdown keeps them."""
from __future__ import annotations

import re

from trainer.pretrain import prepare, tokenizers
from trainer.pretrain import plays
from trainer.pretrain.shards import read_shard
from trainer.cli import main


def test_render_turns_markdown_markup_into_play_text():
    md = ("# Romeo and Juliet\n\n## ACT II\n\n### SCENE II. Capulet's orchard.\n\n_Enter ROMEO_\n\n"
          "**ROMEO**  \nBut, soft! what light through yonder window breaks?  \nIt is the east.\n\n"
          "**JULIET**  \n_\\[Aside]_  \nAy me! \\-- *sighs*\n\n\n\n_Exeunt_\n")
    assert plays.render(md) == ("Romeo and Juliet\n\nACT II\n\nSCENE II. Capulet's orchard.\n\nEnter ROMEO\n\n"
                                "ROMEO:\nBut, soft! what light through yonder window breaks?\nIt is the east.\n\n"
                                "JULIET:\n[Aside]\nAy me! -- sighs\n\nExeunt\n")


def test_prepare_renders_the_embedded_corpus_as_speaker_turns_and_markdown_on_request(tmp_path, capsys):
    assert main(["prepare", "--out", str(tmp_path / "plain")]) == 0
    assert main(["prepare", "--markdown", "--out", str(tmp_path / "md")]) == 0
    enc = tokenizers.gpt2()
    plain = enc.decode(read_shard(tmp_path / "plain" / "train_000000.bin").tolist())
    md = enc.decode(read_shard(tmp_path / "md" / "train_000000.bin").tolist())
    assert "**" not in plain and "**ROMEO**" in md
    assert not re.search(r" +\n", plain)  # no Markdown line breaks (trailing spaces)
    turns = re.findall(r"^([A-Z][A-Z .'\-]+):$", plain, re.M)
    assert len(turns) > 20000 and "ROMEO" in turns and "HAMLET" in turns
    assert "\nROMEO:\n" in plain
    # Cached separately from the Markdown tokens: resolving the default corpus gives the plain text.
    plays_md = prepare.collect(None)
    assert prepare.cache_key(None) == prepare.content_hash(plays_md, prepare.Settings(render_plays=True)) != \
        prepare.content_hash(plays_md, prepare.Settings(render_plays=False))
