"""Source lists as spreadsheets and editors save them: encodings, line ends, separators, header spelling.

Each variant is compared with the plain form (UTF-8, LF, comma, lower-case header) of the same list: the
`SourceItem`s must be equal, not merely "it parses".
"""

from __future__ import annotations

import codecs
import json
import shutil
from pathlib import Path

import pytest

from vidray.data.ingest import SourceItem, prepare, read_source
from vidray.errors import UserError, UserFileNotFound

EDGE_DIR = Path(__file__).resolve().parents[1] / "data" / "edge"

# Captions with a comma, quotes, an accent and a line break inside a quoted cell.
ROWS = [
    ("clips/hiker.mp4", 'A hiker, on a summit, says "hello"', "49", "8"),
    ("stills/café.png", "Ünïcödé caption\nwith a second line", "", ""),
    ("clips/boat.mp4", "a sailboat", "9", "7.5"),
]


def _csv_text(sep: str = ",", newline: str = "\n", header: tuple[str, ...] = ("path", "text", "num_frames", "fps")
              ) -> str:
    def cell(value: str) -> str:
        if any(c in value for c in (sep, '"', "\n")):
            return '"' + value.replace('"', '""').replace("\n", newline) + '"'
        return value

    lines = [sep.join(header)] + [sep.join(cell(v) for v in row) for row in ROWS]
    return newline.join(lines) + newline


def _write(path: Path, text: str, encoding: str = "utf-8") -> Path:
    path.write_bytes(text.encode(encoding))
    return path


@pytest.fixture
def plain(tmp_path) -> list[SourceItem]:
    items = read_source(_write(tmp_path / "plain.csv", _csv_text()))
    assert [item.listed_path for item in items] == [row[0] for row in ROWS]
    assert items[1].text == "Ünïcödé caption\nwith a second line"
    assert items[0].hints == {"num_frames": 49, "fps": 8.0} and items[1].hints == {}
    assert items[1].is_image and items[1].file_path == tmp_path / "stills" / "café.png"
    return items


def test_the_spreadsheet_export_reads_exactly_like_the_same_csv_without_bom_and_with_lf(tmp_path):
    raw = (EDGE_DIR / "spreadsheet_export.csv").read_bytes()
    assert raw.startswith(codecs.BOM_UTF8) and b"\r\n" in raw  # the case under test: BOM + CRLF
    plain_bytes = raw[len(codecs.BOM_UTF8):].replace(b"\r\n", b"\n")
    (tmp_path / "spreadsheet_export.csv").write_bytes(plain_bytes)
    exported = read_source(EDGE_DIR / "spreadsheet_export.csv")
    plain = read_source(tmp_path / "spreadsheet_export.csv")
    # Same entries except the folder their relative paths resolve against.
    assert [(i.listed_path, i.text, i.is_image, i.hints) for i in exported] == [
        (i.listed_path, i.text, i.is_image, i.hints) for i in plain
    ]
    assert [i.listed_path for i in exported] == ["h264_8bit_320x240.mp4", "portrait_240x320_ref.mp4"]
    assert exported[0].text == "a grey test card with coloured corners"
    assert all(i.file_path.is_file() for i in exported)


def test_the_spreadsheet_export_prepares_both_clips(tmp_path):
    summary = prepare(EDGE_DIR / "spreadsheet_export.csv", tmp_path / "shards", [[9, 64, 96], [9, 96, 64]], 8.0, 8,
                      progress=None)
    assert (summary.num_kept, summary.num_skipped) == (2, 0)


@pytest.mark.parametrize(
    ("name", "text", "encoding"),
    [
        ("bom.csv", _csv_text(), "utf-8-sig"),
        ("crlf.csv", _csv_text(newline="\r\n"), "utf-8"),
        ("cr.csv", _csv_text(newline="\r"), "utf-8"),
        ("bom_crlf.csv", _csv_text(newline="\r\n"), "utf-8-sig"),
        ("semicolon.csv", _csv_text(sep=";"), "utf-8"),
        ("tab.tsv", _csv_text(sep="\t"), "utf-8"),
        ("tab.csv", _csv_text(sep="\t", newline="\r\n"), "utf-8"),
        ("utf16.csv", _csv_text(sep="\t", newline="\r\n"), "utf-16"),  # Excel "Unicode Text": BOM, LE, tabs
        ("utf16be.csv", _csv_text(), "utf-16-be-bom"),
        ("header_case_space.csv", _csv_text(header=("Path", " TEXT ", "Num_Frames ", " fps")), "utf-8"),
        ("excel_sep_line.csv", "sep=;\n" + _csv_text(sep=";"), "utf-8"),
        ("trailing_empty_rows.csv", _csv_text() + ",,,\n,,,\n\n", "utf-8"),
        ("padded_cells.csv", _csv_text().replace("clips/boat.mp4,a sailboat", "  clips/boat.mp4 , a sailboat "),
         "utf-8"),
    ],
)
def test_spreadsheet_variants_read_like_the_plain_csv(tmp_path, plain, name, text, encoding):
    path = tmp_path / name
    if encoding == "utf-16-be-bom":
        path.write_bytes(codecs.BOM_UTF16_BE + text.encode("utf-16-be"))
    else:
        _write(path, text, encoding)
    assert read_source(path) == plain


def test_embedded_line_breaks_and_commas_stay_inside_their_quoted_cell(tmp_path, plain):
    items = read_source(_write(tmp_path / "quoted.csv", _csv_text(newline="\r\n")))
    assert len(items) == 3  # the line break inside row 2's caption does not start a row
    assert items[0].text == 'A hiker, on a summit, says "hello"'
    assert items[1].text == "Ünïcödé caption\nwith a second line"  # CRLF inside the cell reads as LF


def test_a_non_utf8_csv_is_refused_naming_the_byte_line_and_the_fix(tmp_path):
    path = _write(tmp_path / "legacy.csv", "path,text\na.mp4,plain\nb.mp4,un café crème\n", "cp1252")
    with pytest.raises(UserError, match=r"not UTF-8: byte 0xe9 on line 3 .*'CSV UTF-8'"):
        read_source(path)


def test_utf16_without_a_byte_order_mark_is_refused_not_misread(tmp_path):
    path = _write(tmp_path / "nobom.csv", _csv_text(), "utf-16-le")
    with pytest.raises(UserError, match="NUL bytes: UTF-16 or UTF-32 text without a byte-order mark"):
        read_source(path)


def test_utf32_is_refused_not_read_as_utf16(tmp_path):
    path = _write(tmp_path / "utf32.csv", _csv_text(), "utf-32")  # starts FF FE 00 00, a UTF-16 BOM + NUL
    with pytest.raises(UserError, match="is UTF-32 text"):
        read_source(path)


def test_a_json_source_with_a_utf8_bom_reads_like_without(tmp_path):
    entries = [{"file_path": "a.mp4", "text": "ein Bär", "type": "video"}, {"file_path": "b.png", "text": "x"}]
    body = json.dumps(entries, ensure_ascii=False)
    with_bom = read_source(_write(tmp_path / "bom.json", body, "utf-8-sig"))
    assert with_bom == read_source(_write(tmp_path / "plain.json", body))
    assert with_bom[0].text == "ein Bär" and with_bom[1].is_image
    assert read_source(_write(tmp_path / "utf16.json", body, "utf-16")) == with_bom


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("path;text\n", "lists no files"),
        ("path,path,text\na,a,x\n", r"column\(s\) \['path'\] appear more than once"),
        ("file;caption\na.mp4;x\n", r"missing column\(s\) \['path', 'text'\].*read as semicolon-separated"),
        ("path,text\n,orphan caption\n", "line 2: empty 'path'"),
        ("sep=|\npath|text\na.mp4|x\n", None),
    ],
)
def test_csv_structure_errors_name_the_problem(tmp_path, content, message):
    path = _write(tmp_path / "data.csv", content)
    if message is None:  # Excel's sep= line may name any of , ; tab |
        assert [(i.listed_path, i.text) for i in read_source(path)] == [("a.mp4", "x")]
        return
    with pytest.raises(UserError, match=message):
        read_source(path)


def test_a_missing_source_is_a_user_file_not_found(tmp_path):
    with pytest.raises(UserFileNotFound, match="does not exist"):
        read_source(tmp_path / "nope.csv")
    assert issubclass(UserFileNotFound, FileNotFoundError)


def test_a_txt_export_is_refused_with_the_rename_hint(tmp_path):
    shutil.copy(EDGE_DIR / "spreadsheet_export.csv", tmp_path / "export.txt")
    with pytest.raises(UserError, match="renamed to .tsv"):
        read_source(tmp_path / "export.txt")


def test_an_unquoted_comma_in_a_caption_is_an_error_naming_line_counts_and_the_quote_fix(tmp_path):
    path = _write(tmp_path / "data.csv", "path,text\nok.mp4,fine\nrot180.mp4,a horse, galloping\n")
    with pytest.raises(UserError) as err:
        read_source(path)  # was read as caption 'a horse', the rest dropped
    message = str(err.value)
    assert str(path) in message and "line 3" in message and "3 cells but the header has 2 columns" in message
    assert 'quote the caption: "a horse, galloping"' in message


def test_extra_cells_after_hint_columns_are_an_error_too(tmp_path):
    path = _write(tmp_path / "data.csv", "path,text,fps\na.mp4,x,8,oops\n")
    with pytest.raises(UserError, match=r"line 2: 4 cells but the header has 3 columns.*quote the caption"):
        read_source(path)


def test_trailing_empty_cells_of_a_spreadsheet_row_are_still_accepted(tmp_path):
    items = read_source(_write(tmp_path / "data.csv", "path,text\na.mp4,x,,\n"))
    assert [(i.listed_path, i.text) for i in items] == [("a.mp4", "x")]


def test_a_row_too_short_to_reach_the_caption_is_an_error(tmp_path):
    path = _write(tmp_path / "data.csv", "path,text,fps\na.mp4\n")
    with pytest.raises(UserError, match=r"line 2: 1 cell\(s\) but the header has 3 columns"):
        read_source(path)


def test_a_semicolon_csv_with_decimal_comma_hints_reads_them_as_numbers(tmp_path):
    path = _write(tmp_path / "data.csv", "Path;Text;num_frames;fps\na.mp4;a horse, galloping;120;29,97\n")
    items = read_source(path)  # was refused: "column fps must be a number"
    assert items[0].text == "a horse, galloping"
    assert items[0].hints == {"num_frames": 120, "fps": 29.97}


def test_an_unparseable_hint_is_ignored_with_one_warning_per_column(tmp_path, caplog):
    path = _write(tmp_path / "data.csv", "path,text,fps,width\na.mp4,x,fast,wide\nb.mp4,y,slow,64\nc.mp4,z,8,\n")
    with caplog.at_level("WARNING", logger="vidray.data.ingest"):
        items = read_source(path)
    assert [i.hints for i in items] == [{}, {"width": 64}, {"fps": 8.0}]
    warnings = sorted(r.getMessage().split(": ", 1)[1] for r in caplog.records)  # one per column, not per row
    assert len(warnings) == 2
    assert warnings[0].startswith("column fps is not a number on 2 row(s) (line 2, 3") and "ignored" in warnings[0]
    assert warnings[1].startswith("column width is not a number on 1 row(s) (line 2")


def test_a_folder_as_source_says_to_give_the_list_inside_it(tmp_path):
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "metadata.json").write_text("[]")
    with pytest.raises(UserError, match=r"is a folder: give the \.json or \.csv list inside it \(metadata\.json\)"):
        read_source(tmp_path / "clips")


@pytest.mark.parametrize("key", ["shards_dir", "source"])
@pytest.mark.parametrize("value", ["", "   ", "\"\"", "\"  \""])
def test_an_empty_shards_dir_or_source_is_refused_at_config_load(key, value):
    from vidray.config import load_job_config

    with pytest.raises(UserError, match=rf"data\.{key} is empty: give .*e\.g\. "):
        load_job_config(None, [f"data.{key}={value}"])


def test_empty_captions_and_repeated_listings_are_kept_and_counted(tmp_path, samples_dir):
    hiker = str(samples_dir / "finetrainers_hiker_tiny_368x240.mp4")
    boat = str(samples_dir / "animatediff_sailboat_painting.png")
    source = _write(tmp_path / "data.csv", f'path,text\n{hiker},"  "\n{boat},a sailboat\n{boat},a boat again\n')
    summary = prepare(source, tmp_path / "shards", [[9, 64, 64], [1, 64, 64]], 8.0, 64, progress=None)
    assert summary.num_kept == 3 and summary.num_samples == 3  # no behaviour change: all kept
    text = str(summary)
    assert "Empty captions (kept): 1 (finetrainers_hiker_tiny_368x240.mp4)" in text
    assert "Listed more than once: 1 extra listing(s) (animatediff_sailboat_painting.png)" in text
    report = json.loads(summary.report_path.read_text())
    assert report["num_empty_captions"] == 1 and report["empty_captions"] == [hiker]
    assert report["num_duplicate_listings"] == 1 and report["duplicate_listings"] == [boat]
