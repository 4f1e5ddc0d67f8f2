"""One Update of every type Telegram documents, built with python-telegram-bot's own classes
(so the JSON is Telegram's shape), every user-supplied field holding a value a test can look
for on a page: `Secrets.text` and `Secrets.number` return their value and remember it.

Values are picked to be findable on a page (numbers of five or more characters, words with
no spaces), not to be plausible: a heading of 35917 degrees masks like one of 359.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import telegram as tg

WHEN = datetime(2023, 11, 14, 22, 13, 20, tzinfo=UTC)


class Secrets:
    """The user-supplied values one update holds."""

    def __init__(self) -> None:
        self.values: list[str] = []

    def text(self, value: str) -> str:
        self.values.append(value)
        return value

    def number(self, value: float) -> Any:
        self.values.append(str(value))
        return value


def user(s: Secrets, n: int = 1) -> tg.User:
    return tg.User(
        id=4242 + n,
        is_bot=False,
        first_name=s.text(f"Alice{n}"),
        last_name=s.text(f"Liddell{n}"),
        username=s.text(f"alice_wonder{n}"),
        language_code=s.text(f"en-AU{n}"),
        is_premium=True,
    )


def private_chat(s: Secrets) -> tg.Chat:
    return tg.Chat(
        id=4243,
        type="private",
        first_name=s.text("AliceChat"),
        last_name=s.text("LiddellChat"),
        username=s.text("alice_chat"),
    )


def group(s: Secrets) -> tg.Chat:
    return tg.Chat(id=-1001234, type="supergroup", title=s.text("KnittingCircle"), username=s.text("knit_club"))


def channel(s: Secrets) -> tg.Chat:
    return tg.Chat(id=-1005678, type="channel", title=s.text("DiaryChannel"), username=s.text("diary_feed"))


def location(s: Secrets) -> tg.Location:
    return tg.Location(
        latitude=s.number(48.858093),
        longitude=s.number(2.294694),
        horizontal_accuracy=s.number(17.375),
        live_period=s.number(86397),
        heading=s.number(35917),
        proximity_alert_radius=s.number(65432),
    )


def address(s: Secrets) -> tg.ShippingAddress:
    return tg.ShippingAddress(
        country_code=s.text("NZ"),
        state=s.text("Canterbury"),
        city=s.text("Christchurch"),
        street_line1=s.text("12OrchardLane"),
        street_line2=s.text("Flat3B"),
        post_code=s.text("PC8011"),
    )


def order_info(s: Secrets) -> tg.OrderInfo:
    return tg.OrderInfo(
        name=s.text("AliceFullName"),
        phone_number=s.text("+64211234567"),
        email=s.text("alice@example.org"),
        shipping_address=address(s),
    )


def poll(s: Secrets) -> tg.Poll:
    return tg.Poll(
        id="5012345678901234",
        question=s.text("DoYouVoteGreen"),
        question_entities=[tg.MessageEntity(type="bold", offset=0, length=2)],
        options=[
            tg.PollOption(text=s.text("YesGreen"), voter_count=3, persistent_id="opt-yes"),
            tg.PollOption(text=s.text("NoGreen"), voter_count=1, persistent_id="opt-no"),
        ],
        total_voter_count=4,
        is_closed=False,
        is_anonymous=False,
        type="quiz",
        allows_multiple_answers=False,
        allows_revoting=False,
        members_only=False,
        correct_option_ids=[s.number(60011)],
        explanation=s.text("BecauseReasons"),
        open_period=s.number(86391),
        close_date=WHEN,
    )


def invite_link(s: Secrets) -> tg.ChatInviteLink:
    return tg.ChatInviteLink(
        invite_link=s.text("https://t.me/+SecretInvite"),
        creator=user(s, 2),
        creates_join_request=False,
        is_primary=False,
        is_revoked=False,
        name=s.text("LinkForBob"),
    )


def message(s: Secrets) -> tg.Message:
    """A message with every kind of content at once: Telegram sends one kind per message, and
    masking goes by field, so one message covers them all."""
    earlier = tg.Message(message_id=499, date=WHEN, chat=private_chat(s), text=s.text("EarlierWords"))
    return tg.Message(
        message_id=501,
        message_thread_id=7,
        date=WHEN,
        edit_date=WHEN,
        chat=private_chat(s),
        from_user=user(s),
        sender_chat=group(s),
        business_connection_id="bc-1",
        author_signature=s.text("SignedAlice"),
        text=s.text("MeetMeAtNoon"),
        entities=[
            tg.MessageEntity(type="text_link", offset=0, length=4, url=s.text("https://alice.example/diary")),
            tg.MessageEntity(type="text_mention", offset=5, length=2, user=user(s, 3)),
            tg.MessageEntity(type="pre", offset=8, length=2, language=s.text("brainfudge")),
        ],
        caption=s.text("HolidayPhoto"),
        forward_origin=tg.MessageOriginHiddenUser(date=WHEN, sender_user_name=s.text("HiddenHarry")),
        reply_to_message=earlier,
        external_reply=tg.ExternalReplyInfo(
            origin=tg.MessageOriginChannel(
                date=WHEN, chat=channel(s), message_id=9, author_signature=s.text("ExtSignature")
            ),
            chat=channel(s),
            message_id=9,
        ),
        quote=tg.TextQuote(text=s.text("QuotedWords"), position=s.number(70001), is_manual=True),
        link_preview_options=tg.LinkPreviewOptions(is_disabled=False, url=s.text("https://preview.example/p")),
        via_bot=tg.User(id=99, is_bot=True, first_name=s.text("HelperBot"), username=s.text("helper_bot")),
        document=tg.Document(
            file_id="BQACAgQAAx0-doc",
            file_unique_id="AgADdoc",
            file_name=s.text("medical-report.pdf"),
            mime_type="application/pdf",
            file_size=123456,
        ),
        photo=[tg.PhotoSize(file_id="AgACAgQAAx0-photo", file_unique_id="AQADphoto", width=90, height=90)],
        audio=tg.Audio(
            file_id="CQACAgQAAx0-audio",
            file_unique_id="AgADaudio",
            duration=120,
            performer=s.text("SingerSue"),
            title=s.text("LullabySong"),
        ),
        sticker=tg.Sticker(
            file_id="CAACAgQAAx0-sticker",
            file_unique_id="AgADsticker",
            width=512,
            height=512,
            is_animated=False,
            is_video=False,
            type="regular",
            emoji=s.text("🦄"),
            set_name=s.text("AliceStickerSet"),
        ),
        contact=tg.Contact(
            phone_number=s.text("+64219876543"),
            first_name=s.text("CarolContact"),
            last_name=s.text("CarolSurname"),
            user_id=777,
            vcard=s.text("BEGIN:VCARD-CarolCard"),
        ),
        dice=tg.Dice(value=s.number(40961), emoji=s.text("🎰")),
        location=location(s),
        venue=tg.Venue(
            location=location(s),
            title=s.text("SecretClinic"),
            address=s.text("1HarleyStreet"),
            foursquare_id=s.text("4b0588f9fsq"),
            foursquare_type=s.text("medical/clinic"),
            google_place_id=s.text("ChIJplaceid"),
            google_place_type=s.text("doctor_office"),
        ),
        poll=poll(s),
        game=tg.Game(
            title=s.text("SnakeGame"),
            description=s.text("EatTheApples"),
            photo=[tg.PhotoSize(file_id="AgACAgQAAx0-game", file_unique_id="AQADgame", width=90, height=90)],
            text=s.text("HighScoreText"),
        ),
        invoice=tg.Invoice(
            title=s.text("InsulinPens"),
            description=s.text("ThreeMonthSupply"),
            start_parameter=s.text("start-pens"),
            currency=s.text("NZD"),
            total_amount=s.number(14599),
        ),
        successful_payment=tg.SuccessfulPayment(
            currency=s.text("XTR"),
            total_amount=s.number(14598),
            invoice_payload=s.text("invoice-payload-77"),
            telegram_payment_charge_id="tg-charge-1",
            provider_payment_charge_id="provider-charge-1",
            shipping_option_id="express",
            order_info=order_info(s),
        ),
        web_app_data=tg.WebAppData(data=s.text("WebAppSecretData"), button_text=s.text("OpenShop")),
        users_shared=tg.UsersShared(
            request_id=1,
            users=[
                tg.SharedUser(
                    user_id=555, first_name=s.text("SharedSam"), last_name=s.text("Sharer"), username=s.text("sam_s")
                )
            ],
        ),
        chat_shared=tg.ChatShared(
            request_id=2, chat_id=-1009999, title=s.text("SharedGroup"), username=s.text("shared_group_sg")
        ),
        new_chat_title=s.text("NewGroupTitle"),
        new_chat_members=[user(s, 4)],
        left_chat_member=user(s, 5),
        proximity_alert_triggered=tg.ProximityAlertTriggered(
            traveler=user(s, 6), watcher=user(s, 7), distance=s.number(48213)
        ),
        write_access_allowed=tg.WriteAccessAllowed(web_app_name=s.text("ShopWebApp")),
        passport_data=tg.PassportData(
            data=[
                tg.EncryptedPassportElement(
                    type="personal_details",
                    hash=s.text("element-hash-1"),
                    data=s.text("EncryptedDetails"),
                    phone_number=s.text("+64217654321"),
                    email=s.text("passport@example.org"),
                )
            ],
            credentials=tg.EncryptedCredentials(
                data=s.text("EncryptedCreds"), hash=s.text("creds-hash-1"), secret=s.text("CredsSecret")
            ),
        ),
        connected_website=s.text("shop.example.net"),
        checklist=tg.Checklist(
            title=s.text("PackingList"), tasks=[tg.ChecklistTask(id=1, text=s.text("PackPassport"))]
        ),
        api_kwargs={"some_field_telegram_adds_in_2031": s.text("NotYetDocumented")},
    )


def chat_member(s: Secrets) -> tg.ChatMemberUpdated:
    return tg.ChatMemberUpdated(
        chat=group(s),
        from_user=user(s),
        date=WHEN,
        old_chat_member=tg.ChatMemberMember(user=user(s, 2), until_date=WHEN),
        new_chat_member=tg.ChatMemberAdministrator(
            user=user(s, 2),
            can_be_edited=False,
            is_anonymous=False,
            can_manage_chat=True,
            can_delete_messages=True,
            can_manage_video_chats=False,
            can_restrict_members=False,
            can_promote_members=False,
            can_change_info=False,
            can_invite_users=True,
            can_post_stories=False,
            can_edit_stories=False,
            can_delete_stories=False,
            custom_title=s.text("ChiefKnitter"),
        ),
        invite_link=invite_link(s),
        via_join_request=False,
    )


def _inline_query(s: Secrets) -> tg.InlineQuery:
    return tg.InlineQuery(
        id="iq-1",
        from_user=user(s),
        query=s.text("WhereToBuyInsulin"),
        offset=s.text("page-two-offset"),
        chat_type="sender",
        location=location(s),
    )


# update type -> the object it carries, built for one Secrets.
BODIES: dict[str, Callable[[Secrets], tg.TelegramObject]] = {
    **dict.fromkeys(
        (
            "message",
            "edited_message",
            "channel_post",
            "edited_channel_post",
            "business_message",
            "edited_business_message",
            "guest_message",
        ),
        message,
    ),
    "inline_query": _inline_query,
    "chosen_inline_result": lambda s: tg.ChosenInlineResult(
        result_id="r-1",
        from_user=user(s),
        query=s.text("ChosenQueryWords"),
        location=location(s),
        inline_message_id="imid-2",
    ),
    "callback_query": lambda s: tg.CallbackQuery(
        id="cbq-1",
        from_user=user(s),
        chat_instance="-881234",
        message=message(s),
        data=s.text("pay:order-77-card-4111"),
        game_short_name=s.text("snake_short"),
    ),
    "shipping_query": lambda s: tg.ShippingQuery(
        id="sq-1", from_user=user(s), invoice_payload=s.text("invoice-payload-78"), shipping_address=address(s)
    ),
    "pre_checkout_query": lambda s: tg.PreCheckoutQuery(
        id="pcq-1",
        from_user=user(s),
        currency=s.text("EUR"),
        total_amount=s.number(14597),
        invoice_payload=s.text("invoice-payload-79"),
        shipping_option_id="express",
        order_info=order_info(s),
    ),
    "purchased_paid_media": lambda s: tg.PaidMediaPurchased(
        from_user=user(s), paid_media_payload=s.text("paid-media-payload-9")
    ),
    "poll": poll,
    "poll_answer": lambda s: tg.PollAnswer(
        poll_id="5012345678901234",
        option_ids=[s.number(60013), s.number(60017)],
        option_persistent_ids=[s.text("VotedOptionYes")],
        user=user(s),
        voter_chat=group(s),
    ),
    "my_chat_member": chat_member,
    "chat_member": chat_member,
    "chat_join_request": lambda s: tg.ChatJoinRequest(
        chat=group(s),
        from_user=user(s),
        date=WHEN,
        user_chat_id=4243,
        bio=s.text("ILoveKnittingBio"),
        invite_link=invite_link(s),
    ),
    "chat_boost": lambda s: tg.ChatBoostUpdated(
        chat=channel(s),
        boost=tg.ChatBoost(
            boost_id="boost-1", add_date=WHEN, expiration_date=WHEN, source=tg.ChatBoostSourcePremium(user(s))
        ),
    ),
    "removed_chat_boost": lambda s: tg.ChatBoostRemoved(
        chat=channel(s), boost_id="boost-1", remove_date=WHEN, source=tg.ChatBoostSourcePremium(user(s))
    ),
    "message_reaction": lambda s: tg.MessageReactionUpdated(
        chat=group(s),
        message_id=501,
        date=WHEN,
        old_reaction=[tg.ReactionTypeEmoji(s.text("🤮"))],
        new_reaction=[tg.ReactionTypeCustomEmoji("5368324170671202286"), tg.ReactionTypePaid()],
        user=user(s),
    ),
    "message_reaction_count": lambda s: tg.MessageReactionCountUpdated(
        chat=channel(s),
        message_id=501,
        date=WHEN,
        reactions=[tg.ReactionCount(type=tg.ReactionTypeEmoji(s.text("🙈")), total_count=5)],
    ),
    "business_connection": lambda s: tg.BusinessConnection(
        id="bc-1", user=user(s), user_chat_id=4243, date=WHEN, is_enabled=True, rights=tg.BusinessBotRights()
    ),
    "deleted_business_messages": lambda s: tg.BusinessMessagesDeleted(
        business_connection_id="bc-1", chat=private_chat(s), message_ids=[501, 502]
    ),
    "managed_bot": lambda s: tg.ManagedBotUpdated(
        user=user(s),
        bot=tg.User(id=98, is_bot=True, first_name=s.text("ManagedShopBot"), username=s.text("managed_shop_bot")),
    ),
}


def update_of(update_type: str, update_id: int) -> tuple[dict[str, Any], list[str]]:
    """An Update of this type as Telegram's JSON, and the user-supplied values in it."""
    s = Secrets()
    body = BODIES[update_type](s).to_dict()
    return {"update_id": update_id, update_type: body}, s.values


def sent_message() -> tuple[dict[str, Any], list[str], dict[str, Any], list[str]]:
    """A bot's answer: the payload of its sendMessage and the Message Telegram returned, each
    with its user-supplied values."""
    in_payload, in_result = Secrets(), Secrets()
    button = {"text": in_payload.text("TrackParcel"), "callback_data": in_payload.text("track:77")}
    payload = {
        "chat_id": 4243,
        "text": in_payload.text("YourPensShipTomorrow"),
        "parse_mode": "HTML",
        "reply_markup": {"inline_keyboard": [[button]]},
    }
    return payload, in_payload.values, message(in_result).to_dict(), in_result.values
