"""vLLM-Omni's video form → a stageferry job: field names, conversions, media slots, and clear refusals.

vLLM-Omni (``POST /v1/videos`` and ``/v1/videos/sync``) takes multipart fields named after OpenAI's
videos API plus diffusion extensions; MiniMax-H3 style models add ``extra_params`` (JSON) with
``task``, ``duration``, ``aspect_ratio`` and ``audio_flow_shift``.  This module maps each onto a
:class:`~stageferry.schemas.JobRequest` field and records where every job field came from, so that a
field error names the field *as the client sent it* (``extra_params.audio_flow_shift``, ``seconds``).

Anything with no equivalent here — an unknown field or ``extra_params`` key, a Wan2.2-only knob such as
``guidance_scale_2``, a LoRA given by path — is a 400 naming it, never silently dropped.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stageferry.config import Limits
from stageferry.errors import field_error
from stageferry.gateway.errors import invalid, invalid_fields
from stageferry.gateway.uploads import ParsedForm, UploadedFile
from stageferry.schemas import MediaInputs, Task, json_text
from stageferry.schemas.validation import field_errors

#: Text fields whose value may carry a whole upload as a data URL.
DATA_URL_FIELDS = ("image_reference", "audio_reference")
#: OpenAI's ``input_reference`` given as an object (the SDK sends ``input_reference={"image_url": ...}``
#: as these form fields): a data URL of an image, or an uploaded file's id (which this gateway has none of).
IMAGE_URL_FIELD, FILE_ID_FIELD = "input_reference[image_url]", "input_reference[file_id]"
#: Text fields that may be as large as an upload.
LARGE_TEXT_FIELDS = (*DATA_URL_FIELDS, IMAGE_URL_FIELD)
#: vLLM-Omni fields with no equivalent in this pipeline: refused by name rather than ignored.
UNSUPPORTED_FIELDS = frozenset({
    "guidance_scale_2", "boundary_ratio", "true_cfg_scale", "enable_frame_interpolation", "frame_interpolation_exp",
    "frame_interpolation_scale", "frame_interpolation_model_path", "generate_sound", "sound_duration", "video_params",
})  # fmt: skip
#: Keys of ``extra_params`` and the job field each one sets.
EXTRA_PARAMS = {
    "task": "task",
    "duration": "duration",
    "aspect_ratio": "aspect_ratio",
    "audio_flow_shift": "audio_flow_shift",
    "num_frames": "num_frames",
    "negative_prompt": "negative_prompt",
    "guidance_scale": "guidance",
    "lora": "lora",
}
#: Named aspect ratios → the default size used when the request gives no width/height (multiples of 16).
ASPECT_SIZES = {"16:9": (1344, 768), "9:16": (768, 1344), "1:1": (1024, 1024), "4:3": (1152, 864), "3:4": (864, 1152)}
#: How far width/height may be from a stated aspect ratio (1344×768 is 1.6 % off 16:9).
ASPECT_TOLERANCE = 0.06
#: Upload fields: stageferry's own media names, then vLLM-Omni's.
MEDIA_FIELDS = (*MediaInputs.model_fields, "input_reference", "last_image", "input_references")


class VideoForm(BaseModel):
    """The text fields of ``POST /v1/videos[/sync]`` (multipart; files are listed in the OpenAPI schema)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # nan: "finite", as inf

    prompt: str = Field(description="What to generate.")
    model: str | None = Field(None, max_length=256, description="Echoed back; the deployment decides the model.")
    user: str | None = Field(None, max_length=256, description="Caller's identifier (accepted, not used).")
    negative_prompt: str | None = None
    seconds: Annotated[float, Field(gt=0)] | None = Field(None, description="Duration; same as extra_params.duration.")
    size: Annotated[str, Field(pattern=r"^\d+x\d+$")] | None = Field(None, description="WIDTHxHEIGHT.")
    width: int | None = None
    height: int | None = None
    fps: int | None = None
    num_frames: int | None = None
    num_inference_steps: int | None = None
    seed: int | None = None
    flow_shift: float | None = None
    guidance_scale: float | None = Field(None, description="Maps to the job's guidance.")
    aspect_ratio: str | None = Field(None, description="e.g. 16:9; also accepted in extra_params.")
    lora: str | None = Field(None, description='A configured adapter: a name, or JSON {"name": ...}.')
    extra_params: str | None = Field(
        None, description="JSON object: task, duration, aspect_ratio, audio_flow_shift, num_frames, negative_prompt."
    )
    image_reference: str | None = Field(None, description='JSON {"image_url": "data:image/png;base64,..."}.')
    audio_reference: str | None = Field(None, description='JSON {"audio_url": "data:audio/wav;base64,..."}.')


def openapi_request_body() -> dict[str, Any]:
    """The request body for the OpenAPI document: multipart (the text fields plus the upload fields), or a
    JSON object (the text fields, ``input_reference`` as OpenAI's image reference object)."""
    schema = VideoForm.model_json_schema()
    for name in MEDIA_FIELDS:
        file_schema = {"type": "string", "format": "binary"}
        schema["properties"][name] = (
            {"type": "array", "items": file_schema} if name == "input_references" else dict(file_schema)
        )
    text_only = {**schema, "properties": {k: v for k, v in schema["properties"].items() if k not in MEDIA_FIELDS}}
    json_schema = {**text_only, "properties": {**text_only["properties"], "input_reference": _IMAGE_URL_OBJECT}}
    return {
        "content": {"multipart/form-data": {"schema": schema}, "application/json": {"schema": json_schema}},
        "required": True,
    }


#: ``input_reference`` in a JSON body: OpenAI's image reference object (no file parts in JSON).
_IMAGE_URL_OBJECT = {
    "type": "object",
    "properties": {"image_url": {"type": "string", "description": "a data URL (data:image/png;base64,...)"}},
    "additionalProperties": False,
}


@dataclass(slots=True)
class MappedJob:
    """The job data, the media bytes by slot, and where each job field came from in the form."""

    job: dict[str, Any]
    uploads: dict[str, bytes]
    origin: dict[str, str] = field(default_factory=dict)
    model: str | None = None


class _Builder:
    """Collects job fields from several sources; one field set twice to different values is an error."""

    def __init__(self) -> None:
        self.job: dict[str, Any] = {}
        self.origin: dict[str, str] = {}
        self.uploads: dict[str, bytes] = {}
        self.errors: list[dict[str, Any]] = []
        #: Per slot with uploads beyond its first: how many, and where in ``errors`` its one error stands.
        self.duplicates: dict[str, tuple[int, int]] = {}

    def put(self, job_field: str, value: Any, source: str) -> None:
        if value is None:
            return
        if job_field in self.job and self.job[job_field] != value:
            first = self.origin[job_field]
            self.errors.append(field_error(source, f"conflicts with {first} ({self.job[job_field]!r})", "conflict"))
            return
        self.job[job_field] = value
        self.origin.setdefault(job_field, source)

    def media(self, slot: str, data: bytes, source: str) -> None:
        if slot in self.uploads:  # one error a slot, however many more came (50 images: one error, not 48)
            extra, at = self.duplicates.get(slot, (0, len(self.errors)))
            extra += 1
            shown = "a second" if extra == 1 else f"{extra} more"
            message = f"{shown} {slot} (a job takes one; the first came from {self.origin['media.' + slot]})"
            self.errors[at : at + 1] = [field_error(source, message, "duplicate_media")]  # added, or replaced
            self.duplicates[slot] = (extra, at)
            return
        self.uploads[slot] = data
        self.origin["media." + slot] = source


#: The tasks a deployment serves when the caller does not say (``Limits.tasks``'s default).
DEFAULT_TASKS: tuple[Task, ...] = Limits.model_fields["tasks"].default


def map_form(form: ParsedForm, tasks: Collection[Task] = DEFAULT_TASKS) -> MappedJob:
    """The job for a parsed form; :class:`ApiError` (400) naming every field that cannot be mapped.

    ``tasks``: those the deployment serves (``limits.tasks``), which a task inferred from the uploads
    follows (one image on a deployment that serves i2va is an i2va job)."""
    fields = dict(form.fields)
    image_url, file_id = fields.pop(IMAGE_URL_FIELD, None), fields.pop(FILE_ID_FIELD, None)
    if file_id is not None:
        message = "file ids are not supported: upload the image, or give input_reference.image_url as a data URL"
        raise invalid("input_reference.file_id", message, "unsupported")
    unknown = [name for name in fields if name not in VideoForm.model_fields]
    errors = [
        field_error(n, "not supported by this deployment", "unsupported")
        if n in UNSUPPORTED_FIELDS
        else field_error(n, "unknown field", "unknown_field")
        for n in unknown
    ]
    errors += [field_error(f.field, "unknown upload field", "unknown_field") for f in form.files
               if f.field not in MEDIA_FIELDS]  # fmt: skip
    if errors:
        raise invalid_fields(errors)
    try:
        parsed = VideoForm.model_validate(fields)
    except ValidationError as exc:
        raise invalid_fields(field_errors(exc)) from exc

    b = _Builder()
    for name in ("prompt", "negative_prompt", "width", "height", "fps", "num_frames", "num_inference_steps", "seed",
                 "flow_shift"):  # fmt: skip
        b.put(name, getattr(parsed, name), name)
    b.put("guidance", parsed.guidance_scale, "guidance_scale")
    b.put("duration", parsed.seconds, "seconds")
    if parsed.size is not None:
        width, height = (int(v) for v in parsed.size.split("x"))
        b.put("width", width, "size")
        b.put("height", height, "size")
    if parsed.lora is not None:
        b.put("lora", _lora_name(parsed.lora, "lora"), "lora")
    aspect: tuple[str, str] | None = (parsed.aspect_ratio, "aspect_ratio") if parsed.aspect_ratio else None
    for key, value in _extra_params(parsed.extra_params).items():
        source = f"extra_params.{key}"
        if key == "aspect_ratio":
            if aspect is not None and aspect[0] != value:
                b.errors.append(field_error(source, f"conflicts with {aspect[1]} ({aspect[0]!r})", "conflict"))
            aspect = (str(value), source)
        elif key == "lora":
            b.put("lora", _lora_name(value, source), source)
        else:
            b.put(EXTRA_PARAMS[key], value.lower() if key == "task" and isinstance(value, str) else value, source)
    if aspect is not None:
        _apply_aspect(b, *aspect)
    inferred = "task" not in b.job and _infer_task(b, form, parsed, image_url is not None, tasks)
    _map_media(b, form, parsed)
    if image_url is not None:  # the image of an input_reference object: where an uploaded one would go
        data = _data_url(json.dumps({"image_url": image_url}), "input_reference", "image_url")
        if str(b.job.get("task", "t2va")).lower() == "ref2va":
            _reference_media(
                b, UploadedFile("input_reference.image_url", "", "image/*", data), "input_reference.image_url"
            )
        else:
            b.media("first_frame", data, "input_reference.image_url")
    if inferred and b.job["task"] == "fl2va" and "first_frame" in b.uploads and "last_frame" not in b.uploads:
        b.uploads["last_frame"] = b.uploads["first_frame"]  # one image: the clip starts and ends on it
        b.origin["media.last_frame"] = b.origin["media.first_frame"]
    if b.errors:
        raise invalid_fields(b.errors)
    return MappedJob(job=b.job, uploads=b.uploads, origin=b.origin, model=parsed.model)


def _extra_params(raw: str | None) -> dict[str, Any]:
    if raw is None or not raw.strip():
        return {}
    try:
        value = json_text.loads(raw)
    except ValueError:
        raise invalid("extra_params", "not valid JSON", "json_invalid") from None
    if not isinstance(value, dict):
        raise invalid("extra_params", "must be a JSON object", "dict_type")
    unknown = [k for k in value if k not in EXTRA_PARAMS]
    if unknown:
        allowed = ", ".join(EXTRA_PARAMS)
        raise invalid_fields([field_error(f"extra_params.{k}", f"unknown key (known: {allowed})", "unknown_field")
                              for k in unknown])  # fmt: skip
    return value


def _lora_name(raw: Any, source: str) -> str:
    """An adapter name from ``"name"``, ``{"name": ...}`` (vLLM-Omni's aliases too); paths are refused."""
    if isinstance(raw, str):
        try:
            raw = json_text.loads(raw) if raw.lstrip().startswith("{") else raw
        except ValueError:
            raise invalid(source, "not valid JSON", "json_invalid") from None
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, dict):
        raise invalid(source, "give an adapter name or a JSON object with 'name'", "lora_type")
    names = [raw[k] for k in ("name", "lora_name", "adapter") if k in raw]
    for key in raw:
        if key in ("path", "lora_path", "local_path", "int_id", "lora_int_id"):
            raise invalid(f"{source}.{key}", "only configured adapters, by name, can be used", "unsupported")
        if key in ("scale", "lora_scale") and raw[key] != 1 and raw[key] != 1.0:
            raise invalid(f"{source}.{key}", "adapter scales other than 1.0 are not supported", "unsupported")
        if key not in ("name", "lora_name", "adapter", "scale", "lora_scale"):
            raise invalid(f"{source}.{key}", "unknown key", "unknown_field")
    if len(names) != 1 or not isinstance(names[0], str):
        raise invalid(source, "give exactly one adapter name", "lora_type")
    return names[0]


def _apply_aspect(b: _Builder, ratio: str, source: str) -> None:
    """A named ratio sets the size when none is given, and must agree with the size when one is."""
    match = re.fullmatch(r"\s*(\d{1,3})\s*:\s*(\d{1,3})\s*", ratio)
    if match is None or int(match[1]) == 0 or int(match[2]) == 0:
        b.errors.append(field_error(source, "must look like 16:9", "aspect_ratio"))
        return
    wanted = int(match[1]) / int(match[2])
    width, height = b.job.get("width"), b.job.get("height")
    if width is None and height is None:
        if ratio.strip() not in ASPECT_SIZES:
            known = ", ".join(ASPECT_SIZES)
            b.errors.append(field_error(source, f"without width/height, use one of {known}", "aspect_ratio"))
            return
        w, h = ASPECT_SIZES[ratio.strip()]
        b.put("width", w, source)
        b.put("height", h, source)
    elif (
        isinstance(width, int)
        and isinstance(height, int)
        and height > 0
        and abs(width / height - wanted) / wanted > ASPECT_TOLERANCE
    ):
        b.errors.append(field_error(source, f"{ratio} does not match width×height {width}×{height}", "aspect_ratio"))


#: Upload fields whose media kind their name says.
_KIND_OF_FIELD = {"first_frame": "image", "last_frame": "image", "last_image": "image", "reference_audio": "audio",
                  "reference_video": "video", "image_reference": "image", "audio_reference": "audio"}  # fmt: skip


def _infer_task(b: _Builder, form: ParsedForm, parsed: VideoForm, image_url: bool, tasks: Collection[Task]) -> bool:
    """With no task named, the one the uploads imply (an OpenAI client cannot name one), among those the
    deployment serves: a video or audio is ref2va; one image is the first frame of an i2va job where the
    deployment serves i2va, else of an fl2va job (the image its first and last frame); two images fl2va.
    True when a task was inferred; no upload leaves the default (t2va)."""
    kinds = [(_KIND_OF_FIELD.get(up.field) or media_kind(up.content_type, up.data), up.field) for up in form.files]
    kinds += [(_KIND_OF_FIELD[name], name) for name in DATA_URL_FIELDS if getattr(parsed, name) is not None]
    kinds += [("image", "input_reference.image_url")] if image_url else []
    if not kinds:
        return False
    other = [source for kind, source in kinds if kind != "image"]
    if other:
        task, source = Task.REF2VA, other[0]
    else:
        single = len(kinds) == 1 and kinds[0][1] not in ("last_frame", "last_image")
        task, source = (Task.I2VA if single and Task.I2VA in tasks else Task.FL2VA), kinds[0][1]
    b.put("task", task.value, f"{source} (task inferred)")
    return True


def _map_media(b: _Builder, form: ParsedForm, parsed: VideoForm) -> None:
    """Uploads (and data URLs) → media slots, following the task as vLLM-Omni's H3 server does."""
    task = str(b.job.get("task", "t2va")).lower()
    for up in form.files:
        if up.field in MediaInputs.model_fields:
            b.media(up.field, up.data, up.field)
        elif up.field == "last_image":
            b.media("last_frame", up.data, up.field)
        elif task == "ref2va":
            _reference_media(b, up, up.field)
        elif up.field == "input_reference" or "first_frame" not in b.uploads:
            b.media("first_frame", up.data, up.field)
        else:
            b.media("last_frame", up.data, up.field)
    if parsed.image_reference is not None:
        data = _data_url(parsed.image_reference, "image_reference", "image_url")
        if task == "ref2va":
            _reference_media(b, UploadedFile("image_reference", "", "image/*", data), "image_reference")
        else:
            b.media("first_frame", data, "image_reference")
    if parsed.audio_reference is not None:
        b.media("reference_audio", _data_url(parsed.audio_reference, "audio_reference", "audio_url"), "audio_reference")


def _reference_media(b: _Builder, up: UploadedFile, source: str) -> None:
    kind = media_kind(up.content_type, up.data)
    if kind == "audio":
        b.media("reference_audio", up.data, source)
    elif kind == "image":
        b.errors.append(field_error(source, "ref2va takes a reference video and/or audio, not an image", "bad_media"))
    else:
        b.media("reference_video", up.data, source)


def media_kind(content_type: str, data: bytes) -> str:
    """``image``, ``audio`` or ``video``: from the part's type, else from the first bytes."""
    major = content_type.split("/", 1)[0]
    if major in ("image", "audio", "video"):
        return major
    head = data[:16]
    if head.startswith((b"\x89PNG", b"\xff\xd8\xff", b"GIF8")) or head[8:12] == b"WEBP":
        return "image"
    if head[8:12] == b"WAVE" or head.startswith((b"ID3", b"fLaC", b"OggS", b"\xff\xfb", b"\xff\xf3")):
        return "audio"
    return "video"


def _data_url(raw: str, source: str, key: str) -> bytes:
    """The bytes of ``{"<key>": "data:...;base64,..."}``; remote URLs are refused (the gateway fetches nothing)."""
    try:
        value = json_text.loads(raw)
    except json.JSONDecodeError as exc:
        if raw.lstrip().startswith("{"):  # JSON meant, and broken: often a base64 wrapped onto several lines
            hint = " (a line break inside the base64? send it on one line)" if "control character" in exc.msg else ""
            raise invalid(source, f"not valid JSON: {exc.msg}{hint}", "json_invalid") from None
        value = raw  # a bare URL is accepted too
    url = value.get(key) if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise invalid(source, f"give JSON {{{key!r}: 'data:...;base64,...'}}", "reference_type")
    match = re.fullmatch(r"data:[\w.+/-]*(?:;[\w=.-]+)*;base64,(.*)", url.strip(), flags=re.DOTALL)
    if match is None:
        if url.strip().startswith("data:") and ";base64," in url:
            message = "a malformed data URL (data:<media type>;base64,<data>)"
        elif url.strip().startswith("data:"):
            message = "only base64 data URLs are accepted (data:<media type>;base64,<data>)"
        else:
            message = "only base64 data URLs are accepted: the gateway fetches no URL (upload the file instead)"
        raise invalid(f"{source}.{key}", message, "reference_url")
    try:
        return base64.b64decode(match[1], validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"{source}.{key}", "not valid base64", "reference_url") from None
