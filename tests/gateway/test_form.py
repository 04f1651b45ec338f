"""Form → job mapping and the streaming form reader, without a deployment (pure functions, no I/O)."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator

import anyio
import pytest

import stageferry.gateway
from stageferry.cli import sample_media
from stageferry.gateway.errors import ApiError
from stageferry.gateway.form import map_form
from stageferry.gateway.uploads import ParsedForm, UploadedFile, read_form
from stageferry.schemas import Task

SAMPLES = sample_media(Task.FL2VA) | sample_media(Task.REF2VA)


def test_public_names() -> None:
    assert stageferry.gateway.__all__ == ["GatewayConfig", "create_app", "serve"]


def test_vllm_omni_names_map_onto_the_job() -> None:
    extra = {"task": "T2VA", "audio_flow_shift": 2.5, "aspect_ratio": "16:9"}
    fields = {"prompt": "p", "size": "512x288", "seconds": "4", "guidance_scale": "4.5", "fps": "16",
              "lora": '{"lora_name": "style-a", "scale": 1.0}', "model": "MiniMax-H3",
              "extra_params": json.dumps(extra)}  # fmt: skip
    mapped = map_form(ParsedForm(fields=fields))
    assert mapped.job == {"prompt": "p", "fps": 16, "guidance": 4.5, "duration": 4.0, "width": 512, "height": 288,
                          "lora": "style-a", "task": "t2va", "audio_flow_shift": 2.5}  # fmt: skip
    assert mapped.origin["guidance"] == "guidance_scale" and mapped.origin["width"] == "size"
    assert mapped.origin["audio_flow_shift"] == "extra_params.audio_flow_shift" and mapped.model == "MiniMax-H3"


def test_aspect_ratio_alone_chooses_a_size() -> None:
    job = map_form(ParsedForm(fields={"prompt": "p", "aspect_ratio": "9:16"})).job
    assert (job["width"], job["height"]) == (768, 1344)


def test_references_go_to_their_slots() -> None:
    video, audio = SAMPLES["reference_video"].read_bytes(), SAMPLES["reference_audio"].read_bytes()
    files = [UploadedFile("input_references", "v", "application/octet-stream", video),  # kind sniffed
             UploadedFile("input_references", "a", "application/octet-stream", audio)]  # fmt: skip
    mapped = map_form(ParsedForm({"prompt": "p", "extra_params": '{"task": "ref2va"}'}, files))
    assert mapped.uploads == {"reference_video": video, "reference_audio": audio}

    first, last = SAMPLES["first_frame"].read_bytes(), SAMPLES["last_frame"].read_bytes()
    files = [UploadedFile("input_references", "a", "image/png", first),
             UploadedFile("input_references", "b", "image/png", last)]  # fmt: skip
    mapped = map_form(ParsedForm({"prompt": "p", "extra_params": '{"task": "fl2va"}'}, files))
    assert mapped.uploads == {"first_frame": first, "last_frame": last}
    assert mapped.origin["media.first_frame"] == "input_references"

    url = "data:image/png;base64," + base64.b64encode(first).decode()
    fields = {"prompt": "p", "extra_params": '{"task": "fl2va"}', "image_reference": json.dumps({"image_url": url})}
    assert map_form(ParsedForm(fields, [UploadedFile("last_image", "b", "image/png", last)])).uploads == {
        "first_frame": first,
        "last_frame": last,
    }


@pytest.mark.parametrize(
    ("fields", "files", "field"),
    [
        ({"image_reference": '{"image_url": "https://example.invalid/a.png"}'}, [], "image_reference.image_url"),
        ({"extra_params": '{"task": "ref2va"}'}, [UploadedFile("input_reference", "a", "image/png", b"")],
         "input_reference"),
        ({}, [UploadedFile("thumbnail", "a", "image/png", b"")], "thumbnail"),
        ({"lora": '{"name": "a", "scale": 0.5}'}, [], "lora.scale"),
        ({"aspect_ratio": "7:5"}, [], "aspect_ratio"),
        ({"extra_params": "[1, 2]"}, [], "extra_params"),
    ],
)  # fmt: skip
def test_what_cannot_be_mapped_is_named(fields: dict[str, str], files: list[UploadedFile], field: str) -> None:
    with pytest.raises(ApiError) as caught:
        map_form(ParsedForm({"prompt": "p", **fields}, files))
    assert caught.value.status == 400 and caught.value.body()["error"]["param"] == field


async def _chunks(body: bytes, size: int = 1000) -> AsyncIterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start : start + size]


def _multipart(*parts: tuple[str, str | None, bytes]) -> bytes:
    out = b""
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--xx\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + b"\r\n"
    return out + b"--xx--\r\n"


HEADERS = {"content-type": "multipart/form-data; boundary=xx"}


@pytest.mark.anyio
async def test_form_reader_caps_each_upload_while_streaming() -> None:
    body = _multipart(("prompt", None, b"p"), ("first_frame", "a.png", b"x" * 5000))
    seen: list[int] = []

    async def counted() -> AsyncIterator[bytes]:
        async for chunk in _chunks(body):
            seen.append(len(chunk))
            yield chunk

    with pytest.raises(ApiError) as caught:
        await read_form(HEADERS, counted(), max_file_bytes=2048, max_body_bytes=1 << 20)
    assert caught.value.status == 413 and caught.value.body()["error"]["param"] == "first_frame"
    assert sum(seen) < len(body)  # refused before the body was read whole

    form = await read_form(HEADERS, _chunks(body), max_file_bytes=8192, max_body_bytes=1 << 20)
    assert form.fields == {"prompt": "p"} and [(f.field, len(f.data)) for f in form.files] == [("first_frame", 5000)]


@pytest.mark.anyio
async def test_form_reader_refusals() -> None:
    twice = _multipart(("prompt", None, b"a"), ("prompt", None, b"b"))
    with pytest.raises(ApiError) as caught:
        await read_form(HEADERS, _chunks(twice), max_file_bytes=1024, max_body_bytes=1 << 20)
    assert caught.value.status == 400 and caught.value.body()["error"]["param"] == "prompt"
    with pytest.raises(ApiError) as caught:
        await read_form({"content-type": "text/plain"}, _chunks(b"{}"), max_file_bytes=1024, max_body_bytes=99)
    assert caught.value.status == 415 and "JSON object" in caught.value.message
    with pytest.raises(ApiError) as caught:
        headers = {**HEADERS, "content-length": "100000"}
        await read_form(headers, _chunks(twice), max_file_bytes=1024, max_body_bytes=99)
    assert caught.value.status == 413 and caught.value.body()["error"]["param"] == "body"
    with pytest.raises(ApiError) as caught:
        await read_form(HEADERS, _chunks(b"--xx\r\ngarbage"), max_file_bytes=1024, max_body_bytes=1 << 20)
    assert caught.value.status == 400


def test_an_input_reference_object_gives_its_image_or_is_refused() -> None:
    """OpenAI's input_reference object ({"image_url": ...} / {"file_id": ...}) as multipart fields
    (input_reference[image_url]): the image is the first frame of an inferred image-to-video job; a file
    id, which needs OpenAI's files API, is refused naming it."""
    first = SAMPLES["first_frame"].read_bytes()
    url = "data:image/png;base64," + base64.b64encode(first).decode()
    mapped = map_form(ParsedForm({"prompt": "p", "input_reference[image_url]": url}))
    assert mapped.job["task"] == "fl2va" and mapped.uploads == {"first_frame": first, "last_frame": first}
    assert mapped.origin["media.first_frame"] == "input_reference.image_url"
    with pytest.raises(ApiError) as refused:
        map_form(ParsedForm({"prompt": "p", "input_reference[file_id]": "file-abc"}))
    assert refused.value.field_errors[0]["field"] == "input_reference.file_id"
    with pytest.raises(ApiError) as remote:
        map_form(ParsedForm({"prompt": "p", "input_reference[image_url]": "https://example.invalid/a.png"}))
    assert remote.value.field_errors[0]["field"] == "input_reference.image_url"
    assert "fetches no URL" in remote.value.field_errors[0]["message"]


def test_no_task_named_is_inferred_from_the_uploads() -> None:
    """An OpenAI client cannot name a task: images make it fl2va (one image is both frames), a video or
    audio ref2va, nothing t2va; a named task is never overridden."""
    first, last = SAMPLES["first_frame"].read_bytes(), SAMPLES["last_frame"].read_bytes()
    video, audio = SAMPLES["reference_video"].read_bytes(), SAMPLES["reference_audio"].read_bytes()
    one = map_form(ParsedForm({"prompt": "p"}, [UploadedFile("input_reference", "a.png", "image/png", first)]))
    assert one.job["task"] == "fl2va" and one.uploads == {"first_frame": first, "last_frame": first}
    two = map_form(ParsedForm({"prompt": "p"}, [UploadedFile("input_reference", "a", "image/png", first),
                                               UploadedFile("last_image", "b", "image/png", last)]))  # fmt: skip
    assert two.uploads == {"first_frame": first, "last_frame": last}
    for data, slot in ((video, "reference_video"), (audio, "reference_audio")):
        ref = map_form(
            ParsedForm({"prompt": "p"}, [UploadedFile("input_reference", "x", "application/octet-stream", data)])
        )
        assert ref.job["task"] == "ref2va" and ref.uploads == {slot: data}
    assert "task" not in map_form(ParsedForm({"prompt": "p"})).job  # the schema's t2va
    ltx2 = (Task.T2VA, Task.I2VA)  # a deployment that serves i2va (the diffusers LTX-2 pair) and no fl2va
    i2va = map_form(ParsedForm({"prompt": "p"}, [UploadedFile("input_reference", "a.png", "image/png", first)]), ltx2)
    assert i2va.job["task"] == "i2va" and i2va.uploads == {"first_frame": first}
    url = "data:image/png;base64," + base64.b64encode(first).decode()
    by_url = map_form(ParsedForm({"prompt": "p", "input_reference[image_url]": url}), ltx2)
    assert by_url.job["task"] == "i2va" and by_url.uploads == {"first_frame": first}
    assert by_url.origin["task"] == "input_reference.image_url (task inferred)"
    both = map_form(ParsedForm({"prompt": "p"}, [UploadedFile("input_reference", "a", "image/png", first),
                                                UploadedFile("last_image", "b", "image/png", last)]), ltx2)  # fmt: skip
    assert both.job["task"] == "fl2va"  # two images are fl2va (refused there by name), never a dropped frame
    with pytest.raises(ApiError):  # named ref2va: an image is refused, not taken as fl2va
        map_form(ParsedForm({"prompt": "p", "extra_params": '{"task": "ref2va"}'},
                            [UploadedFile("input_reference", "a.png", "image/png", first)]))  # fmt: skip


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("content_type", "message"),
    [
        ("multipart/form-data; boundary=xx; charset=hex", "charset 'hex' is not supported"),  # not a text codec
        ("multipart/form-data; boundary=xx; charset=punycode", "charset 'punycode' is not supported"),
        ("multipart/form-data; boundary=xx; charset=undefined", "charset 'undefined' is not supported"),
        ("multipart/form-data; boundary=" + "b" * 300, "malformed multipart body: Boundary length 300"),
    ],
)
async def test_a_form_of_an_odd_charset_or_boundary_is_a_400(content_type: str, message: str) -> None:
    """Python knows codecs that are not text, and the multipart parser refuses long boundaries as it is
    made: both were 500s (LookupError, UnicodeError, FormParserError outside the parse's try)."""
    body = _multipart(("prompt", None, b"p"))
    with pytest.raises(ApiError, match=message) as caught:
        await read_form({"content-type": content_type}, _chunks(body), max_file_bytes=1024, max_body_bytes=1 << 20)
    assert caught.value.status == 400


@pytest.mark.anyio
async def test_a_charset_known_to_browsers_is_read_and_an_unknown_name_is_utf8() -> None:
    body = _multipart(("prompt", None, "café".encode("latin-1")))
    headers = {"content-type": "multipart/form-data; boundary=xx; charset=ISO-8859-1"}
    form = await read_form(headers, _chunks(body), max_file_bytes=1024, max_body_bytes=1 << 20)
    assert form.fields == {"prompt": "café"}
    utf8 = _multipart(("prompt", None, "café".encode()))
    headers = {"content-type": "multipart/form-data; boundary=xx; charset=no-such-codec"}
    form = await read_form(headers, _chunks(utf8), max_file_bytes=1024, max_body_bytes=1 << 20)
    assert form.fields == {"prompt": "café"}


@pytest.mark.anyio
async def test_a_body_that_stops_arriving_is_a_408() -> None:
    """A body short of its Content-Length, or chunked without its last chunk: refused once no byte came
    for ``idle_s``, instead of holding the request (and its connection) for as long as the client likes."""
    never = anyio.Event()

    async def stalls() -> AsyncIterator[bytes]:
        yield b'--xx\r\nContent-Disposition: form-data; name="prompt"\r\n\r\np'
        await never.wait()  # the rest never comes
        yield b""

    for content_type in (HEADERS["content-type"], "application/x-www-form-urlencoded"):
        with pytest.raises(ApiError, match=r"no bytes of the request body came for 0\.2 s") as caught:
            await read_form(
                {"content-type": content_type}, stalls(), max_file_bytes=1024, max_body_bytes=1 << 20, idle_s=0.2
            )
        assert caught.value.status == 408 and caught.value.code == "body_stalled"


@pytest.mark.anyio
async def test_a_json_body_is_the_form_it_stands_for() -> None:
    """OpenAI's create-video takes a JSON body too: strings as they are, numbers and booleans as their JSON
    text, ``input_reference`` as the SDK's ``input_reference[image_url]`` field, other objects as JSON
    text (``extra_params``); the same caps and refusals as a form's."""
    headers = {"content-type": "application/json"}

    async def read(body: bytes, max_body_bytes: int = 1 << 20) -> ParsedForm:
        return await read_form(headers, _chunks(body), max_file_bytes=1024, max_body_bytes=max_body_bytes)

    body = {"prompt": "p", "seconds": 4, "size": "256x144", "model": None, "input_reference": {"image_url": "data:x"},
            "extra_params": {"task": "fl2va", "seed": 3}}  # fmt: skip
    form = await read(json.dumps(body).encode())
    assert form.fields == {
        "prompt": "p", "seconds": "4", "size": "256x144", "input_reference[image_url]": "data:x",
        "extra_params": '{"task":"fl2va","seed":3}',
    }  # fmt: skip
    assert form.files == []
    refusals = {
        b"[1, 2]": (400, "must be an object"),
        b'{"prompt": "p"': (400, "does not parse"),
        b"[" * 5000: (400, "does not parse"),  # nested past the recursion limit: a refusal, not a crash
        b'{"input_reference": {"url": "x"}}': (400, "image_url"),
        b'{"prompt": "' + b"x" * 200 + b'"}': (413, "body"),
    }
    for raw, (status, said) in refusals.items():
        with pytest.raises(ApiError) as caught:
            await read(raw, max_body_bytes=100 if status == 413 else 1 << 20)
        assert caught.value.status == status and said in caught.value.message, (raw[:30], caught.value.message)


def test_many_images_for_two_slots_are_one_error_that_says_so() -> None:
    """50 ``input_references`` images on an image-to-video job: one error for the slot they overflow
    (it used to be 48 identical ones), saying how many more came and that a job takes one."""
    png = b"\x89PNG\r\n\x1a\n" + b"\x00" * 32
    files = [UploadedFile("input_references", f"{n}.png", "image/png", png) for n in range(50)]
    with pytest.raises(ApiError) as caught:
        map_form(ParsedForm({"prompt": "p"}, files))
    [error] = caught.value.field_errors
    assert error["field"] == "input_references" and error["type"] == "duplicate_media", error
    assert error["message"] == "48 more last_frame (a job takes one; the first came from input_references)"
