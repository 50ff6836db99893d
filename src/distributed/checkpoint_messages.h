// Private: what ranks tell each other during a collective save
// (distributed/collective_checkpoint.h), as JSON text carried by Communicator::all_gather_strings.
// Every rank runs the same code, so these are encodings between identical builds, not a file
// format.
#pragma once

#include "checkpoint/save_pipeline.h"

#include <nlohmann/json.hpp>

#include <map>
#include <string>

namespace mixprec::distributed::detail {

// A rank's plan (its keys and the chunks of its data file, without checksums).
nlohmann::json plan_to_json(const checkpoint::detail::RankPlan& plan);
checkpoint::detail::RankPlan plan_from_json(const nlohmann::json& json);

// The checksums a rank's writer returned, by stored tensor name.
nlohmann::json written_to_json(const std::map<std::string, checkpoint::WrittenTensor>& written);
std::map<std::string, checkpoint::WrittenTensor> written_from_json(const nlohmann::json& json);

// The options a rank saves with, one field per SaveOptions member under its name, each value
// printable as is (durations as "<count> ms" / "<count> s"): every rank compares them to rank
// 0's.
nlohmann::json options_to_json(const checkpoint::SaveOptions& options);

// The committing rank's result, for every rank to return.
nlohmann::json result_to_json(const checkpoint::SaveResult& result);
checkpoint::SaveResult result_from_json(const nlohmann::json& json);

}  // namespace mixprec::distributed::detail
