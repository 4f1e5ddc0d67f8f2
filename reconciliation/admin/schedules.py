"""django-celery-beat's pages (beat runs the sweeper on their schedules), registered again
where input made them answer 500:

- a crontab's summary raised on a crontab celery cannot parse, and the add form shows that
  summary beside the errors of the crontab it refused: a typo was a 500;
- a periodic task's arguments are checked as JSON, and json's decoder raises RecursionError
  (not a ValueError) past about a thousand levels.
"""

from __future__ import annotations

from typing import Any

from celery.schedules import ParseException
from django import forms
from django.contrib import admin
from django_celery_beat.admin import CrontabScheduleAdmin, PeriodicTaskAdmin, PeriodicTaskForm
from django_celery_beat.models import CrontabSchedule, PeriodicTask

admin.site.unregister([CrontabSchedule, PeriodicTask])


@admin.register(CrontabSchedule)
class ReadableCrontabScheduleAdmin(CrontabScheduleAdmin):
    @admin.display(description="human readable")
    def human_readable(self, obj: CrontabSchedule) -> str:
        try:
            return obj.human_readable
        except ParseException:
            return "(not a crontab celery can read: see the fields' errors)"


class NestingCheckedPeriodicTaskForm(PeriodicTaskForm):
    def _clean_json(self, field: str) -> Any:
        try:
            return super()._clean_json(field)
        except RecursionError as exc:
            raise forms.ValidationError("Unable to parse JSON: nested too deep") from exc


@admin.register(PeriodicTask)
class NestingCheckedPeriodicTaskAdmin(PeriodicTaskAdmin):
    form = NestingCheckedPeriodicTaskForm
