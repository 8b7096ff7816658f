-- hybridpd prefix lookup: ONE round trip for the store hit and every live
-- instance's local hit, under the hybrid rule (see hybridpd/checkpoints.py).
--
-- ARGV[1] key prefix "hpd:<model>:"   ARGV[2] num_tokens   ARGV[3] unit
-- ARGV[4] "1" if EAGLE drops the last block   ARGV[5..] chain hashes (raw bytes)
-- Returns {store_hit, inst_1, hit_1, inst_2, hit_2, ...} (hits in tokens).
--
-- Cost: per group, the leading run of KV blocks is read in MGET/HMGET chunks
-- of CHUNK hashes and stops at the first absent one (a miss costs one chunk,
-- not the whole chain); then single probes for state from the top of that run
-- downwards (the deepest checkpoint is usually found in a probe or two).
local prefix = ARGV[1]
local n_tokens = tonumber(ARGV[2])
local unit = tonumber(ARGV[3])
local eagle = ARGV[4] == "1"
local n = #ARGV - 4
local cap = math.min(n, math.floor((n_tokens - 1) / unit))
if cap < 0 then cap = 0 end
local CHUNK = 128

-- length of the leading run of present entries among hashes 1..cap;
-- probe(first, last) returns presence for hashes first..last (index 1 = first)
local function leading(probe)
  local lead = 0
  while lead < cap do
    local last = math.min(lead + CHUNK, cap)
    local present = probe(lead + 1, last)
    local j = 0
    local m = last - lead
    while j < m and present[j + 1] do j = j + 1 end
    lead = lead + j
    if j < m then break end
  end
  if eagle and lead > 0 then lead = lead - 1 end
  return lead
end

local result = {0}
if cap > 0 then
  local p = prefix .. "kv:"
  local lead = leading(function(first, last)
    local keys = {}
    for i = first, last do keys[i - first + 1] = p .. ARGV[4 + i] end
    return redis.call("MGET", unpack(keys))
  end)
  for i = lead, 1, -1 do
    if redis.call("EXISTS", prefix .. "st:" .. ARGV[4 + i]) == 1 then
      result[1] = i * unit
      break
    end
  end
end

local instances = redis.call("SMEMBERS", prefix .. "instances")
table.sort(instances)
for _, inst in ipairs(instances) do
  if redis.call("EXISTS", prefix .. "hb:" .. inst) == 1 then
    local h = 0
    if cap > 0 then
      local lkv = prefix .. "lkv:" .. inst
      local lead = leading(function(first, last)
        return redis.call("HMGET", lkv, unpack(ARGV, 4 + first, 4 + last))
      end)
      local lst = prefix .. "lst:" .. inst
      for i = lead, 1, -1 do
        if redis.call("HEXISTS", lst, ARGV[4 + i]) == 1 then
          h = i * unit
          break
        end
      end
    end
    table.insert(result, inst)
    table.insert(result, h)
  else
    redis.call("SREM", prefix .. "instances", inst)
  end
end
return result
