"""Event time: watermarks per input (watermark.py), the time lineage of streams (lineage.py), tumbling and hopping windows and interval joins (window.py), and the state cleanup they allow (cleanup.py)."""

from dbsp_core.time.watermark import NO_WATERMARK, EventTime, advance, event_times

__all__ = ["NO_WATERMARK", "EventTime", "advance", "event_times"]
