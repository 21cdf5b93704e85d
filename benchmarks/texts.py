"""Long source texts for the extractive and time-to-first-token scenarios (our own writing).

Extractive tasks (summarize with the source's wording, answer by quoting retrieved documents) are
where prompt lookup pays: the answer copies runs of the prompt. The texts are plain prose with
concrete facts, so a small model has something to copy rather than to invent.
"""

from __future__ import annotations

# A municipal notice in several sections: about 600 tokens with SmolLM2's tokenizer.
REPORT: tuple[str, ...] = (
    ("Riverside Library Renovation: Public Notice\n\n"
    "The Riverside Public Library will close its main building on Elm Street from March 3 to "
    "August 29 for a full renovation. The work is paid for by the city's capital budget and by a "
    "grant of 2.4 million euros from the regional culture fund. During the closure, the library "
    "will run a temporary branch in the former post office at 12 Station Road, open Tuesday to "
    "Saturday from 10 am to 6 pm."),
    ("What changes. The renovation replaces the roof, the heating system and all windows, which "
    "should cut the building's energy use by about 45 percent. The ground floor will get a new "
    "children's area with a reading garden, and the second floor will get six quiet study rooms "
    "that can be booked online for up to three hours a day. A lift will make every floor "
    "accessible, and the main entrance will get a ramp and automatic doors."),
    ("Borrowing during the closure. All loans that are due while the main building is closed are "
    "extended to September 15, and no late fees will be charged until then. Books can be returned "
    "at the temporary branch or at the drop box outside the town hall, which is emptied every "
    "morning. Holds placed before March 3 will be delivered to the temporary branch. The online "
    "catalogue, the e-book service and the audiobook app stay available the whole time."),
    ("Events and services. Story time for children moves to the community center on Park Lane, "
    "every Wednesday at 4 pm. The English conversation group and the computer help desk move to "
    "the temporary branch and keep their usual times. The local history archive will be closed "
    "until the renovation ends, but researchers can request scanned documents by email, and the "
    "archive staff will answer within five working days."),
    ("Jobs and volunteers. The library will hire two extra staff members for the temporary branch "
    "and is looking for volunteers to help move about 80,000 books in late February. Volunteers "
    "must be at least 16 years old and can sign up at the front desk or on the library's website "
    "until February 20. Each volunteer shift lasts four hours, and lunch is provided."),
    ("Reopening. The library plans to reopen on Saturday, August 30, with a street party on Elm "
    "Street from 11 am to 5 pm, a book sale, and guided tours of the new building every hour. "
    "If the work runs late, the new date will be announced on the website and in the city "
    "newsletter at least two weeks in advance. Questions can be sent to the library's help line "
    "at 555 0142, open on weekdays from 9 am to 5 pm."),
)

EXTRACTIVE_INSTRUCTION = (
    "Summarize the notice below for library users. Reuse the notice's own wording and keep every "
    "date, time, place and number exactly as written."
)

# The TTFT prompt is a long reading task: the notice and two shorter documents, cycled until the
# prompt reaches its token target, then a question. Its content does not matter for prefill time,
# but natural text keeps the prompt a realistic one.
EXTRA_DOCS: tuple[str, ...] = (
    ("The Harbor Bridge will be closed to cars from 10 pm Friday to 6 am Monday while crews replace "
    "the expansion joints. Buses will detour over the Mill Street Bridge and add about ten minutes "
    "to each trip. Cyclists and pedestrians can still cross on the north walkway, which stays open "
    "the whole weekend. The city asks drivers to use the ring road and to avoid the old town."),
    ("The Orion greenhouse grows tomatoes, basil and peppers under LED lights, using 40 percent less "
    "water than open fields. Its harvest is sold at the Saturday market on Quay Square from 8 am to "
    "1 pm. Visitors can tour the greenhouse on the first Sunday of each month; tickets cost 5 euros "
    "and children enter free."),
)
LONG_QUESTION = "Using the documents above, list every date mentioned and what happens on it."
